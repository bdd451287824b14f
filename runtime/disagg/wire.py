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
DTYPES = ("float32", "bfloat16", "float16")
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
    """What must match for one server's KV pages to be copied into another's."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    # KV canary (docs/kv-canary.md): slot tags travel in the aux record; byte checksums of the
    # slots too unless "none". Both sides must agree, or one would send what the other ignores.
    canary_tags: bool = False
    canary_bytes: str = "none"

    def __post_init__(self) -> None:
        check_types(self)
        for name, most in (("num_layers", 4096), ("page_size", 4096), ("num_kv_heads", 4096),
                           ("head_dim", 4096)):
            in_range(f"KVLayout.{name}", getattr(self, name), 1, most)
        if self.dtype not in DTYPES:
            raise ValueError(f"KVLayout.dtype: {self.dtype!r} is not one of {DTYPES}")
        if self.canary_bytes not in CANARY_BYTES:
            raise ValueError(f"KVLayout.canary_bytes: {self.canary_bytes!r} is not one of "
                             f"{CANARY_BYTES}")

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: K and V of every layer (the page-major pool's unit)."""
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * itemsize

    def mismatch(self, other: KVLayout) -> str | None:
        """None if pages can move between the two; else what differs, for an error message."""
        mine, theirs = asdict(self), asdict(other)
        diffs = [f"{k} {mine[k]} vs {theirs[k]}" for k in mine if mine[k] != theirs[k]]
        return "; ".join(diffs) or None


@dataclass
class PeerRegistration:
    """Decode -> prefill, once per pair: where to send, and the backend's own connection info."""

    decode_id: str
    receiver_host: str
    receiver_port: int
    layout: dict[str, Any]
    backend: str
    backend_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_types(self)
        short_text("PeerRegistration.decode_id", self.decode_id, MAX_ID, 1)
        short_text("PeerRegistration.receiver_host", self.receiver_host, MAX_ID, 1)
        in_range("PeerRegistration.receiver_port", self.receiver_port, 1, 65535)
        short_text("PeerRegistration.backend", self.backend, MAX_ID, 1)
        KVLayout(**self.layout)  # raises on a bad layout

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout(**self.layout)


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
    """tcp backend: `nbytes` of KV follow, layer by layer, K then V, pages in `dst_pages` order."""

    room: int
    dst_pages: list[int]
    nbytes: int

    def __post_init__(self) -> None:
        check_types(self)
        _room("PagesFrame.room", self.room)
        _pages("PagesFrame.dst_pages", self.dst_pages)
        in_range("PagesFrame.nbytes", self.nbytes, 0, 1 << 62)


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
