"""What prefill and decode servers exchange, and how it travels on a socket.

Decode -> prefill goes over HTTP to the prefill's bootstrap server (bootstrap.py): JSON bodies
built from `KVLayout`, `PeerRegistration` and `RoomRequest`. Prefill -> decode goes over one TCP
link per (prefill, decode) pair to the decode's receiver (receiver.py) as frames: a 4-byte
big-endian length, a msgpack header (one of the dataclasses below), then `PagesFrame.nbytes` of
raw KV when the header is a PagesFrame (tcp backend). Frames of one link arrive in order, so a
room's pages always land before its RoomDone. The nixl backend sends no PagesFrame or RoomDone:
its WRITE's notification is the AuxRecord, encoded by the same codec.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

from runtime.codec import Codec

_LEN = struct.Struct(">I")
MAX_HEADER = 64 << 20


@dataclass(frozen=True)
class KVLayout:
    """What must match for one server's KV pages to be copied into another's."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

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


@dataclass
class RoomRequest:
    """Decode -> prefill, per request: write this room's prompt KV into these pages of mine."""

    room: int
    decode_id: str
    rid: str
    prompt_len: int
    dst_pages: list[int]


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


@dataclass
class PagesFrame:
    """tcp backend: `nbytes` of KV follow, layer by layer, K then V, pages in `dst_pages` order."""

    room: int
    dst_pages: list[int]
    nbytes: int


@dataclass
class RoomDone:
    """tcp backend: the room's pages (just before, on this link) are complete; its aux record."""

    aux: AuxRecord


@dataclass
class RoomFailed:
    room: int
    reason: str


Frame = PagesFrame | RoomDone | RoomFailed
FRAMES = Codec((AuxRecord, PagesFrame, RoomDone, RoomFailed))


class LinkClosed(ConnectionError):
    pass


def send_frame(sock: socket.socket, frame: Frame, payload: list[memoryview] | None = None) -> None:
    header = FRAMES.encode(frame)
    sock.sendall(_LEN.pack(len(header)) + header)
    for part in payload or ():
        sock.sendall(part)


def recv_frame(sock: socket.socket) -> Frame:
    """The next frame's header (a PagesFrame's payload is still on the socket)."""
    (size,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if size > MAX_HEADER:
        raise LinkClosed(f"frame header of {size} bytes: not a baton peer")
    frame: Frame = FRAMES.decode(recv_exact(sock, size))
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
