"""What prefill and decode servers exchange, and how it travels on a socket.

Decode -> prefill goes over HTTP to the prefill's bootstrap server (bootstrap.py): JSON bodies
built from `KVLayout`, `PeerRegistration` and `RoomRequest`. Prefill -> decode goes over one TCP
link per (prefill, decode) pair to the decode's receiver (receiver.py) as frames: a 4-byte
big-endian length, a msgpack header (one of the dataclasses below), then `PagesFrame.nbytes` of
raw KV when the header is a PagesFrame (tcp backend). Frames of one link arrive in order, so a
room's pages always land before its RoomDone. The nixl backend sends no PagesFrame or RoomDone:
its WRITE's notification is the AuxRecord, encoded by the same codec.

Everything here is checked on construction (`__post_init__`): field types as annotated and
bounds (rooms are 63-bit, ids and texts short, page lists no longer than a pool can be), so a
body or frame from the network either becomes a well-typed object or raises ValueError/TypeError
(CodecError from the codec) before any of it is used. A frame header is bounded by the
receiver's pool (`header_limit`): no allocation follows from an unchecked length.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

from runtime.codec import Codec
from runtime.strict import INT64_MAX, check_types, in_range, short_text

_LEN = struct.Struct(">I")
MAX_PAGES = 1 << 24  # far above any pool's page count; bounds a page list before the pool does
MAX_ID = 128  # decode ids, rids, hosts
MAX_TEXT = 4096  # failure reasons, tickets
MAX_INFO_BYTES = 1 << 20  # an aux record's customized_info, encoded
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}  # a pool's dtypes
DTYPES = tuple(ITEMSIZE)
CANARY_BYTES = ("none", "partial", "all")


def header_limit(num_pages: int, page_size: int = 1) -> int:
    """The largest frame header a pool of `num_pages` pages can need: a PagesFrame naming every
    page (msgpack: at most 9 bytes an index) or a RoomDone with the largest aux record (with
    the KV canary: two int64 per prompt slot)."""
    return MAX_INFO_BYTES + 2 * MAX_TEXT + 9 * num_pages + 18 * num_pages * page_size


def _room(where: str, room: int) -> None:
    in_range(where, room, 0, INT64_MAX)


def _pages(where: str, pages: list[int]) -> None:
    in_range(f"{where} length", len(pages), 0, MAX_PAGES)
    if pages and not (min(pages) >= 0 and max(pages) < MAX_PAGES):
        raise ValueError(f"{where}: page index outside [0, {MAX_PAGES})")


@dataclass(frozen=True)
class KVLayout:
    """What must match for one server's KV pages to be copied into another's, and how its ranks
    split the KV heads (`tp_size`: any TP pairs with any other, runtime/disagg/shares.py)."""

    num_layers: int
    page_size: int
    num_kv_heads: int  # the model's (a rank holds its share: shares.Split)
    head_dim: int
    dtype: str
    # an fp8 pool's per-layer scales (runtime/kvcache/fp8.py KVScales.digest; "" for none): the
    # same bytes mean the same values only under the same scales
    kv_scales: str = ""
    # KV canary (docs/kv-canary.md): slot tags travel in the aux record; byte checksums of the
    # slots too unless "none". Both sides must agree, or one would send what the other ignores.
    canary_tags: bool = False
    canary_bytes: str = "none"
    tp_size: int = 1
    # the deployment revision (runtime/revision.py): KV moves only within one ("" for none)
    revision: str = ""

    def __post_init__(self) -> None:
        check_types(self)
        short_text("KVLayout.revision", self.revision, 64)
        for name, most in (("num_layers", 4096), ("page_size", 4096), ("num_kv_heads", 4096),
                           ("head_dim", 4096), ("tp_size", 4096)):
            in_range(f"KVLayout.{name}", getattr(self, name), 1, most)
        if self.dtype not in DTYPES:
            raise ValueError(f"KVLayout.dtype: {self.dtype!r} is not one of {DTYPES}")
        short_text("KVLayout.kv_scales", self.kv_scales, 64)
        if (self.dtype == "float8_e4m3fn") != bool(self.kv_scales):
            raise ValueError(f"KVLayout: a {self.dtype} layout with kv_scales {self.kv_scales!r} "
                             "(an fp8 pool has scales, no other does)")
        if self.canary_bytes not in CANARY_BYTES:
            raise ValueError(f"KVLayout.canary_bytes: {self.canary_bytes!r} is not one of "
                             f"{CANARY_BYTES}")

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of every KV head: K and V of every layer (a page-major pool's unit
        when there is one rank)."""
        return self.head_bytes * self.num_kv_heads

    @property
    def head_bytes(self) -> int:
        """Bytes of one KV head's part of a page."""
        return 2 * self.num_layers * self.page_size * self.head_dim * ITEMSIZE[self.dtype]

    def pairing(self) -> dict[str, Any]:
        """The fields that must match (all but the TP size; kv_scales only for an fp8 pool and
        the revision only where there is one, so that a layout reads as it did before them)."""
        return {k: v for k, v in asdict(self).items()
                if k != "tp_size" and not (k in ("kv_scales", "revision") and not v)}

    def mismatch(self, other: KVLayout) -> str | None:
        """None if pages can move between the two; else what differs, for an error message."""
        mine, theirs = self.pairing(), other.pairing()
        diffs = [f"{k} {mine.get(k)} vs {theirs.get(k)}" for k in dict.fromkeys([*mine, *theirs])
                 if mine.get(k) != theirs.get(k)]
        return "; ".join(diffs) or None


@dataclass
class PeerRegistration:
    """Decode -> prefill, once per pair: where to send, and the backend's own connection info.
    With several ranks, `ranks` holds the receivers of ranks 1..tp-1 ([host, port] each) and
    `rank_info` their backends' connection info (nixl: each rank's own agent; empty for tcp)."""

    decode_id: str
    receiver_host: str
    receiver_port: int
    layout: dict[str, Any]
    backend: str
    backend_info: dict[str, Any] = field(default_factory=dict)
    ranks: list[list[Any]] = field(default_factory=list)
    rank_info: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_types(self)
        short_text("PeerRegistration.decode_id", self.decode_id, MAX_ID, 1)
        short_text("PeerRegistration.receiver_host", self.receiver_host, MAX_ID, 1)
        in_range("PeerRegistration.receiver_port", self.receiver_port, 1, 65535)
        short_text("PeerRegistration.backend", self.backend, MAX_ID, 1)
        layout = KVLayout(**self.layout)  # raises on a bad layout
        if len(self.ranks) != layout.tp_size - 1:
            raise ValueError(f"PeerRegistration.ranks: {len(self.ranks)} receivers for "
                             f"{layout.tp_size} ranks (rank 0's is receiver_host/port)")
        for i, rank in enumerate(self.ranks, start=1):
            if len(rank) != 2 or not isinstance(rank[0], str) or type(rank[1]) is not int:
                raise ValueError(f"PeerRegistration.ranks[{i}]: [host, port], got {rank!r}")
            short_text(f"PeerRegistration.ranks[{i}] host", rank[0], MAX_ID, 1)
            in_range(f"PeerRegistration.ranks[{i}] port", rank[1], 1, 65535)
        if self.rank_info and len(self.rank_info) != len(self.ranks):
            raise ValueError(f"PeerRegistration.rank_info: {len(self.rank_info)} entries for "
                             f"{len(self.ranks)} ranks past rank 0")

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout(**self.layout)

    def receiver(self, rank: int) -> tuple[str, int]:
        """Where decode rank `rank`'s KV receiver listens."""
        if rank == 0:
            return self.receiver_host, self.receiver_port
        host, port = self.ranks[rank - 1]
        return str(host), int(port)

    def info(self, rank: int) -> dict[str, Any]:
        """Decode rank `rank`'s backend connection info."""
        if rank == 0:
            return self.backend_info
        if not self.rank_info:
            raise ValueError(f"decode {self.decode_id} gave no connection info for rank {rank}")
        return self.rank_info[rank - 1]


@dataclass
class RoomRequest:
    """Decode -> prefill, per request: write this room's prompt KV into these pages of mine."""

    room: int
    decode_id: str
    rid: str
    prompt_len: int
    dst_pages: list[int]
    wait_s: float = 300.0  # the decode waits this long for the KV; no write may start later
    ticket: str | None = None  # the router's signed room ticket (runtime/auth/ticket.py)

    def __post_init__(self) -> None:
        check_types(self)
        _room("RoomRequest.room", self.room)
        short_text("RoomRequest.decode_id", self.decode_id, MAX_ID, 1)
        short_text("RoomRequest.rid", self.rid, 2 * MAX_ID, 1)
        in_range("RoomRequest.prompt_len", self.prompt_len, 1, (1 << 31) - 1)
        _pages("RoomRequest.dst_pages", self.dst_pages)
        in_range("RoomRequest.wait_s", self.wait_s, 0, 1e7)
        if self.ticket is not None:
            short_text("RoomRequest.ticket", self.ticket, MAX_TEXT)


@dataclass
class AuxRecord:
    """The first token and what comes with it; validated by decode against its own request."""

    room: int
    rid: str
    prompt_len: int
    token: int
    logprob: float | None = None
    top_logprobs: list[list[float]] | None = None  # [[token id, logprob], ...]
    customized_info: dict[str, Any] | None = None
    cached_tokens: int = 0  # prompt tokens the prefill found in its prefix cache (usage)
    # KV canary: the tag and byte checksum of each prompt slot as the prefill holds them
    slot_tags: list[int] | None = None
    slot_sums: list[int] | None = None

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("slot_tags", "slot_sums"):
            values = getattr(self, name)
            if values is not None and len(values) != self.prompt_len:
                raise ValueError(f"AuxRecord.{name}: {len(values)} values for {self.prompt_len} "
                                 "prompt slots")
        _room("AuxRecord.room", self.room)
        in_range("AuxRecord.cached_tokens", self.cached_tokens, 0, self.prompt_len)
        short_text("AuxRecord.rid", self.rid, 2 * MAX_ID)
        in_range("AuxRecord.prompt_len", self.prompt_len, 0, (1 << 31) - 1)
        in_range("AuxRecord.token", self.token, 0, (1 << 31) - 1)
        if self.top_logprobs is not None:
            in_range("AuxRecord.top_logprobs length", len(self.top_logprobs), 0, 1024)
            if any(len(pair) != 2 for pair in self.top_logprobs):
                raise ValueError("AuxRecord.top_logprobs: each entry is [token id, logprob]")


@dataclass
class PagesFrame:
    """tcp backend: `nbytes` of KV follow, pages in `dst_pages` order, each page as the pool
    holds it. With `share` [src rank, lo, hi] (tensor parallelism: shares.py), only KV heads
    [lo, hi) of each page, written by that prefill rank, as [layer, K/V, token, head, dim]."""

    room: int
    dst_pages: list[int]
    nbytes: int
    share: list[int] | None = None

    def __post_init__(self) -> None:
        check_types(self)
        _room("PagesFrame.room", self.room)
        _pages("PagesFrame.dst_pages", self.dst_pages)
        in_range("PagesFrame.nbytes", self.nbytes, 0, 1 << 62)
        if self.share is not None:
            if len(self.share) != 3:
                raise ValueError("PagesFrame.share: [src rank, lo, hi]")
            src, lo, hi = self.share
            in_range("PagesFrame.share src rank", src, 0, 4095)
            in_range("PagesFrame.share lo", lo, 0, 4095)
            in_range("PagesFrame.share hi", hi, lo + 1, 4096)


@dataclass
class RoomDone:
    """tcp backend: the room's pages (just before, on this link) are complete; its aux record."""

    aux: AuxRecord

    def __post_init__(self) -> None:
        check_types(self)


@dataclass
class RoomFailed:
    room: int
    reason: str

    def __post_init__(self) -> None:
        check_types(self)
        _room("RoomFailed.room", self.room)
        short_text("RoomFailed.reason", self.reason, MAX_TEXT)


Frame = PagesFrame | RoomDone | RoomFailed
FRAMES = Codec((AuxRecord, PagesFrame, RoomDone, RoomFailed))


class LinkClosed(ConnectionError):
    pass


def send_frame(sock: socket.socket, frame: Frame, payload: list[memoryview] | None = None) -> None:
    header = FRAMES.encode(frame)
    sock.sendall(_LEN.pack(len(header)) + header)
    for part in payload or ():
        sock.sendall(part)


class BadFrame(ValueError):
    """A frame that is no frame of ours (undecodable, ill-typed, out of bounds, too long)."""


def recv_frame(sock: socket.socket, limit: int) -> Frame:
    """The next frame's header (a PagesFrame's payload is still on the socket); BadFrame when
    it is longer than `limit` bytes (see `header_limit`) or not a well-formed frame."""
    (size,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if size > limit:
        raise BadFrame(f"frame header of {size} bytes (at most {limit} here)")
    try:
        frame: Frame = FRAMES.decode(recv_exact(sock, size))
    except ValueError as e:  # CodecError, and what a frame's own checks raise
        raise BadFrame(str(e)) from e
    return frame


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise LinkClosed("peer closed the link")
        got += n
