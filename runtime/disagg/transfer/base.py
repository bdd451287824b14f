"""KVTransfer: moves whole KV pages of one server's pool into another server's pool.

The prefill side writes, the decode side receives. Both register their pool once at start-up
(docs/architecture.md "KV cache layout": the buffer never moves, page p always means the same slots), so a
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
from dataclasses import asdict, dataclass
from typing import Any

from runtime.disagg.wire import AuxRecord, KVLayout, PagesFrame
from runtime.kvcache.pool import KVPool

_BACKENDS = {
    "tcp": "runtime.disagg.transfer.tcp:TcpTransfer",
    "nixl": "runtime.disagg.transfer.nixl:NixlTransfer",
}


class TransferError(RuntimeError):
    """A transfer could not be set up or did not complete (the message says why)."""


class WriteInDoubt(TransferError):
    """A one-sided write that did not finish in time and could not be called off: its bytes
    may still land in the peer's pages."""


def layout_of(pool: KVPool) -> KVLayout:
    dtype = str(pool.dtype).removeprefix("torch.")
    return KVLayout(pool.num_layers, pool.page_size, pool.num_kv_heads, pool.head_dim, dtype)


@dataclass
class _Expected:
    """A room the decode side waits for: the only pages a write for it may touch, and the one
    prefill instance that may write them."""

    pages: list[int]
    given: str | None  # the prefill named by `expect` (the ticket's), if any
    peer: str | None  # None until the prefill's instance id is known (bind_peer)
    landing: bool = False  # tcp: the receiver is filling its pages right now
    written: bool = False  # tcp: a write filled every page (its RoomDone may count)
    revoked: bool = False  # the room ended: no write for it is admitted any more


class KVTransfer(ABC):
    """Prefill side: `connect` a peer, `write` a room. Decode side: `expect` a room (its pages,
    the prefill that may write them), then `arrived(room)` gives its aux record once every page
    is in place (`on_arrival` is called then, from whichever thread saw it); when the room ended,
    `revoke` it and free its pages once that says no write can land, then `discard` it.

    The fence (docs/kv-plane.md): every check and every state change of a room is made under one
    lock, so a write is admitted only into the pages of a room that is expected, not revoked and
    written by its own prefill; `revoke` closes that door and says whether a write is under way.
    A backend whose writes pass through our receiver (tcp) can so refuse every late write;
    a one-sided backend (`one_sided`, nixl) cannot, and the decode role waits for the prefill's
    word instead."""

    name = ""
    one_sided = False

    def __init__(self, pool: KVPool, agent_name: str) -> None:
        self.pool = pool
        self.agent_name = agent_name
        self.layout = layout_of(pool)
        self.on_arrival: Callable[[], None] = lambda: None
        self._rooms: dict[int, _Expected] = {}
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
    def read_pages(self, frame: PagesFrame, link: socket.socket, peer: str) -> bool:
        """A PagesFrame from prefill `peer` arrived on a link: put its payload into the pool if
        the room admits it, else read it into nothing; False when refused (tcp backend only)."""
        raise TransferError(f"{self.name} backend got a PagesFrame; peers disagree on the backend")

    def read_done(self, aux: AuxRecord, peer: str) -> bool:
        """A RoomDone arrived on `peer`'s link, behind its pages (tcp backend only)."""
        raise TransferError(f"{self.name} backend got a RoomDone; peers disagree on the backend")

    def expect(self, room: int, pages: list[int], peer: str | None = None) -> None:
        """`room`'s `pages` may be written from now on, by prefill `peer` (or the one
        `bind_peer` names), until it arrived or is revoked."""
        with self._rooms_lock:
            self._rooms[room] = _Expected(list(pages), peer, peer)

    def bind_peer(self, room: int, peer: str) -> bool:
        """Name the prefill that may write `room` if none is named yet; False when the room is
        revoked or another prefill is named (the caller must not hand it the pages)."""
        with self._rooms_lock:
            e = self._rooms.get(room)
            if e is None or e.revoked:
                return False
            if e.peer is None:
                e.peer = peer
            return e.peer == peer

    def unbind_peer(self, room: int) -> None:
        """Undo `bind_peer` (the prefill it named refused the room: it never had the pages)."""
        with self._rooms_lock:
            e = self._rooms.get(room)
            if e is not None and not e.landing:
                e.peer = e.given

    def peer_of(self, room: int) -> str | None:
        """The prefill that may write `room` (None: not expected, or not known yet)."""
        with self._rooms_lock:
            e = self._rooms.get(room)
            return e.peer if e is not None else None

    def _admit(self, room: int, pages: list[int], peer: str) -> bool:
        """A write of `pages` for `room` from `peer` may start: mark it landing (tcp)."""
        with self._rooms_lock:
            e = self._rooms.get(room)
            if e is None or e.revoked or e.landing or e.peer != peer or e.pages != pages:
                return False
            e.landing = True
            return True

    def _landed(self, room: int, complete: bool) -> None:
        """The write `_admit` let in is over: `complete`, or broken off."""
        with self._rooms_lock:
            e = self._rooms.get(room)
            if e is not None:
                e.landing, e.written = False, complete
            revoked = e is not None and e.revoked
        if revoked:
            self.on_arrival()  # the decode role may free the pages now

    def _arrive(self, aux: AuxRecord, peer: str, written: bool = False) -> bool:
        """Every page of `aux.room` is in place: keep its aux record if the room is expected
        from `peer` (an ended room is not waited for: keeping it would leak) and, where asked
        (`written`), a complete write of its pages was admitted. A revoked room's record is
        kept too: for a one-sided backend it is the proof that its write is over."""
        with self._rooms_lock:
            e = self._rooms.get(aux.room)
            if e is None or e.peer != peer or aux.room in self._arrived:
                return False
            if written and not e.written:
                return False
            self._arrived[aux.room] = aux
        self.on_arrival()
        return True

    def arrived(self, room: int) -> AuxRecord | None:
        """The room's aux record once every page of it is in place, else None."""
        with self._rooms_lock:
            return self._arrived.get(room)

    def revoke(self, room: int) -> bool:
        """Admit no more writes for `room`; True when none is landing now, so its pages may be
        freed (for a one-sided backend that is not enough: see `one_sided`)."""
        with self._rooms_lock:
            e = self._rooms.get(room)
            if e is None:
                return True
            e.revoked = True
            return not e.landing

    def discard(self, room: int) -> None:
        """Forget `room` (it ended and its pages are freed or handed to the scheduler)."""
        with self._rooms_lock:
            self._rooms.pop(room, None)
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
