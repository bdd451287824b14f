"""KVTransfer: moves whole KV pages of one server's pool into another server's pool.

The prefill side writes, the decode side receives. Both register their pool once at start-up
(DESIGN.md "KV cache layout": the buffer never moves, page p always means the same slots), so a
transfer is "these source pages, into those destination pages". The pool is page-major: a page
(K and V of every layer) is one contiguous block of `layout.page_bytes`.
`create_transfer` imports a backend only when it is asked for (nixl is optional).
"""

from __future__ import annotations

import importlib
import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from runtime.disagg.wire import AuxRecord, KVLayout, PagesFrame
from runtime.kvcache.pool import KVPool

_BACKENDS = {
    "tcp": "runtime.disagg.transfer.tcp:TcpTransfer",
    "nixl": "runtime.disagg.transfer.nixl:NixlTransfer",
}


class TransferError(RuntimeError):
    """A transfer could not be set up or did not complete (the message says why)."""


def layout_of(pool: KVPool) -> KVLayout:
    dtype = str(pool.dtype).removeprefix("torch.")
    return KVLayout(pool.num_layers, pool.page_size, pool.num_kv_heads, pool.head_dim, dtype)


class KVTransfer(ABC):
    """Prefill side: `connect` a peer, `write` a room. Decode side: `expect` a room, then
    `arrived(room)` gives its aux record once every page is in place (`on_arrival` is called
    then, from whichever thread saw it), `discard` when the room ended."""

    name = ""

    def __init__(self, pool: KVPool, agent_name: str) -> None:
        self.pool = pool
        self.agent_name = agent_name
        self.layout = layout_of(pool)
        self.on_arrival: Callable[[], None] = lambda: None
        self._expected: set[int] = set()
        self._arrived: dict[int, AuxRecord] = {}
        self._rooms_lock = threading.Lock()

    def describe(self) -> dict[str, Any]:
        """What must match between a prefill and a decode server for this backend to move pages
        between them (the router pairs only servers that agree; `/ready` shows it)."""
        return {"backend": self.name, "layout": asdict(self.layout)}

    def local_info(self) -> dict[str, Any]:
        """What a peer needs to reach this side's pool (sent at peer registration)."""
        return {}

    # ---- prefill side ---------------------------------------------------------------------
    def connect(self, peer_id: str, info: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Get ready to write into peer `peer_id`'s pool (its `local_info()`)."""

    def forget(self, peer_id: str) -> None:  # noqa: B027 - optional hook
        """Drop what `connect` set up (the peer is gone or re-registered)."""

    @abstractmethod
    def write(self, peer_id: str, link: socket.socket, src_pages: list[int], dst_pages: list[int],
              aux: AuxRecord) -> int:
        """Copy src_pages into the peer's dst_pages and deliver `aux` behind them (the peer's
        `arrived(aux.room)` gives it once every page landed); block until written. `link` is
        the ordered prefill->decode link (used by backends that stream over it).
        Returns the bytes moved; raises TransferError or OSError."""

    # ---- decode side ----------------------------------------------------------------------
    def read_pages(self, frame: PagesFrame, link: socket.socket) -> None:
        """A PagesFrame arrived on a link: put its payload into the pool (tcp backend only)."""
        raise TransferError(f"{self.name} backend got a PagesFrame; peers disagree on the backend")

    def read_done(self, aux: AuxRecord) -> None:
        """A RoomDone arrived on a link, behind its pages (tcp backend only)."""
        raise TransferError(f"{self.name} backend got a RoomDone; peers disagree on the backend")

    def expect(self, room: int) -> None:
        """`room`'s pages may be written from now on (until it arrived or is discarded)."""
        with self._rooms_lock:
            self._expected.add(room)

    def _arrive(self, aux: AuxRecord) -> None:
        """Every page of `aux.room` is in place: keep its aux record if the room is expected
        (one that ended already is not waited for: keeping it would leak)."""
        with self._rooms_lock:
            if aux.room not in self._expected:
                return
            self._expected.discard(aux.room)
            self._arrived[aux.room] = aux
        self.on_arrival()

    def arrived(self, room: int) -> AuxRecord | None:
        """The room's aux record once every page of it is in place, else None."""
        with self._rooms_lock:
            return self._arrived.get(room)

    def discard(self, room: int) -> None:
        """Forget `room` (it ended)."""
        with self._rooms_lock:
            self._expected.discard(room)
            self._arrived.pop(room, None)

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


def create_transfer(name: str, pool: KVPool, agent_name: str) -> KVTransfer:
    if name not in _BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}; known: {sorted(_BACKENDS)}")
    module, _, cls = _BACKENDS[name].partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise TransferError(f"KV transfer {name!r} is not available here ({e}); "
                            "use --kv-transfer tcp") from e
    backend: KVTransfer = getattr(mod, cls)(pool, agent_name)
    return backend
