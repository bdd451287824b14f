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
from abc import ABC, abstractmethod
from dataclasses import asdict
from typing import Any

from runtime.disagg.wire import KVLayout, PagesFrame
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
    name = ""

    def __init__(self, pool: KVPool, agent_name: str) -> None:
        self.pool = pool
        self.agent_name = agent_name
        self.layout = layout_of(pool)

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
    def write(
        self,
        peer_id: str,
        link: socket.socket,
        room: int,
        src_pages: list[int],
        dst_pages: list[int],
    ) -> int:
        """Copy src_pages of every buffer into the peer's dst_pages; block until they landed.
        `link` is the ordered prefill->decode link (used by backends that stream over it).
        Returns the bytes moved; raises TransferError or OSError."""

    # ---- decode side ----------------------------------------------------------------------
    def read_pages(self, frame: PagesFrame, link: socket.socket) -> None:
        """A PagesFrame arrived on a link: put its payload into the pool (tcp backend only)."""
        raise TransferError(f"{self.name} backend got a PagesFrame; peers disagree on the backend")

    def expect(self, room: int) -> None:  # noqa: B027 - optional hook
        """`room`'s pages may be written from now on (until it landed or is discarded)."""

    @abstractmethod
    def landed(self, room: int) -> bool:
        """True once every page of `room` is in place by this backend's own signal."""

    def discard(self, room: int) -> None:  # noqa: B027 - optional hook
        """Forget what is known about `room` (it ended)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


def create_transfer(name: str, pool: KVPool, agent_name: str) -> KVTransfer:
    if name not in _BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}; known: {sorted(_BACKENDS)}")
    module, _, cls = _BACKENDS[name].partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise TransferError(
            f"KV transfer {name!r} is not available here ({e}); use --kv-transfer tcp"
        ) from e
    backend: KVTransfer = getattr(mod, cls)(pool, agent_name)
    return backend
