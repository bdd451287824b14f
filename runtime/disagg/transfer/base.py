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
from abc import ABC, abstractmethod
from typing import Any

from runtime.disagg.fence import WriteFence
from runtime.disagg.shares import Share, Split
from runtime.disagg.wire import AuxRecord, KVLayout, PagesFrame, PeerRegistration
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


def layout_of(pool: KVPool, tp: int = 1, kv_heads: int | None = None) -> KVLayout:
    """The layout of a server whose rank holds `pool`: `tp` ranks splitting the model's
    `kv_heads` (default: the pool's, one rank)."""
    dtype = str(pool.dtype).removeprefix("torch.")
    scales = pool.scales.digest if pool.scales is not None else ""
    return KVLayout(pool.num_layers, pool.page_size, kv_heads or pool.num_kv_heads, pool.head_dim,
                    dtype, scales, tp_size=tp)


class KVTransfer(ABC):
    """Moves bytes, nothing more. Prefill side: `connect` a peer, `write` a room. Decode side:
    the backend puts what arrives into the pool through `fence` (runtime/disagg/fence.py), the
    decode's write fence: which pages a write for a room may touch and which prefill may write
    them, checked before a write lands where the backend can (`read_pages`, tcp), and told when
    a room's KV is in place (`fence.arrive`). A one-sided backend (`one_sided`, nixl) cannot
    refuse a write at our door, and the decode role waits for the prefill's word instead."""

    name = ""
    one_sided = False
    uses_links = True  # its pages stream over our links (else they go by the backend's own way)

    def __init__(self, pool: KVPool, agent_name: str, fence: WriteFence | None = None,
                 layout: KVLayout | None = None, rank: int = 0) -> None:
        """`layout`: what peers must agree on (default: the pool's, with no canary tags);
        `rank`: which of the server's TP ranks holds `pool` (its KV heads: `held`)."""
        self.pool = pool
        self.agent_name = agent_name
        self.fence = fence if fence is not None else WriteFence()
        self.layout = layout if layout is not None else layout_of(pool)
        self.rank = rank
        self.split = Split(self.layout.tp_size, self.layout.num_kv_heads)
        self.held = self.split.held(rank)

    def describe(self) -> dict[str, Any]:
        """What must match between a prefill and a decode server for this backend to move pages
        between them (the router pairs only servers that agree, whatever their TP sizes;
        `/ready` shows it)."""
        return {"backend": self.name, "layout": self.layout.pairing()}

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

    @abstractmethod
    def write_share(self, peer: PeerRegistration, link: socket.socket | None, room: int,
                    src_pages: list[int], dst_pages: list[int], share: Share) -> int:
        """Copy this rank's KV heads of `share` from src_pages into decode rank `share.dst`'s
        dst_pages of `peer` (tensor parallelism: runtime/disagg/shares.py), with the word
        that tells that rank's fence the share landed; block until written. `link`: the link
        to that rank (None for a backend that does not stream over links, `uses_links`). No
        aux record follows (`write_done`). Returns the bytes moved."""

    @abstractmethod
    def write_done(self, peer: PeerRegistration, link: socket.socket | None,
                   aux: AuxRecord) -> None:
        """The room's RoomDone (its aux record) to decode rank 0, once every share of every
        rank is written: on `link` (rank 0's), behind rank 0's share, or by the backend."""

    # ---- decode side ----------------------------------------------------------------------
    def read_pages(self, frame: PagesFrame, link: socket.socket, peer: str) -> bool:
        """A PagesFrame from prefill `peer` arrived on a link: put its payload into the pool if
        the room admits it, else read it into nothing; False when refused (tcp backend only)."""
        raise TransferError(f"{self.name} backend got a PagesFrame; peers disagree on the backend")

    def read_done(self, aux: AuxRecord, peer: str) -> bool:
        """A RoomDone arrived on `peer`'s link, behind its pages (tcp backend only)."""
        raise TransferError(f"{self.name} backend got a RoomDone; peers disagree on the backend")

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


def create_transfer(name: str, pool: KVPool, agent_name: str, fence: WriteFence | None = None,
                    layout: KVLayout | None = None, rank: int = 0) -> KVTransfer:
    if name not in _BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}; known: {sorted(_BACKENDS)}")
    module, _, cls = _BACKENDS[name].partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise TransferError(f"KV transfer {name!r} is not available here ({e}); "
                            "use --kv-transfer tcp") from e
    backend: KVTransfer = getattr(mod, cls)(pool, agent_name, fence, layout, rank)
    return backend
