"""tcp backend: pages streamed over the prefill->decode link itself.

The byte stream after a PagesFrame header is the room's pages in list order, each one block
of the page-major pool (K and V of every layer). On a CPU pool both sides use scatter/gather
socket I/O (`sendmsg` from the source pages, `recvmsg_into` the destination pages), so KV goes
from one pool to the other with no copy of ours; runs of adjacent pages travel as one piece. A
pool on a GPU goes through host staging. The room's RoomDone (its aux record) follows its pages
on the link, so it arrives when they are in place. The fallback where nixl is missing.
Every write passes the decode's receiver, which admits it only into the pages of a room expected
from that link's prefill (`WriteFence.admit`, under the lock `revoke` takes): a refused room's
bytes are read into a scratch buffer and dropped, so no late or foreign write lands.
"""

from __future__ import annotations

import socket

import torch

from runtime.disagg.fence import WriteFence
from runtime.disagg.shares import Share, head_slice
from runtime.disagg.transfer.base import KVTransfer, TransferError
from runtime.disagg.wire import (
    AuxRecord,
    KVLayout,
    LinkClosed,
    PagesFrame,
    PeerRegistration,
    RoomDone,
    send_frame,
)
from runtime.kvcache.pool import KVPool

IOV_MAX = 512  # buffers per sendmsg/recvmsg_into call (the kernel allows 1024)
SKIP_CHUNK = 1 << 20


def runs(pages: list[int]) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive page indices, in order."""
    out: list[tuple[int, int]] = []
    for p in pages:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def page_views(rows: torch.Tensor, pages: list[int]) -> list[memoryview]:
    """Memoryviews of these pages of the pool's page rows, in stream order (CPU pools)."""
    return [memoryview(rows[a:b].numpy()).cast("B") for a, b in runs(pages)]  # type: ignore[arg-type]


def skip(sock: socket.socket, nbytes: int) -> None:
    """Read `nbytes` off the link into a small scratch buffer (a refused room's pages)."""
    scratch = memoryview(bytearray(min(nbytes, SKIP_CHUNK)))
    while nbytes:
        got = sock.recv_into(scratch[:min(nbytes, len(scratch))])
        if got == 0:
            raise LinkClosed("peer closed the link in the middle of a room's pages")
        nbytes -= got


def _advance(parts: list[memoryview], i: int, n: int) -> int:
    """Past `n` bytes done from parts[i] on (the last one may be done in part); the next i."""
    while n:
        if n >= len(parts[i]):
            n -= len(parts[i])
            i += 1
        else:
            parts[i], n = parts[i][n:], 0
    return i


def send_views(sock: socket.socket, parts: list[memoryview]) -> None:
    i = 0
    while i < len(parts):
        i = _advance(parts, i, sock.sendmsg(parts[i:i + IOV_MAX]))


def recv_views(sock: socket.socket, parts: list[memoryview]) -> None:
    i = 0
    while i < len(parts):
        got = sock.recvmsg_into(parts[i:i + IOV_MAX])[0]
        if got == 0:
            raise LinkClosed("peer closed the link in the middle of a room's pages")
        i = _advance(parts, i, got)


class TcpTransfer(KVTransfer):
    name = "tcp"

    def __init__(self, pool: KVPool, agent_name: str, fence: WriteFence | None = None,
                 layout: KVLayout | None = None, rank: int = 0) -> None:
        super().__init__(pool, agent_name, fence, layout, rank)
        self.rows = pool.page_rows()  # [num_pages, page_bytes] uint8
        self.on_cpu = pool.device.type == "cpu"

    def write(self, peer_id: str, link: socket.socket, src_pages: list[int], dst_pages: list[int],
              aux: AuxRecord) -> int:
        nbytes = len(src_pages) * self.pool.page_bytes
        send_frame(link, PagesFrame(aux.room, dst_pages, nbytes))
        if self.on_cpu:
            send_views(link, page_views(self.rows, src_pages))
        else:
            src = torch.tensor(src_pages, dtype=torch.int64, device=self.rows.device)
            block = self.rows.index_select(0, src).cpu()
            send_views(link, [memoryview(block.numpy()).cast("B")])  # type: ignore[arg-type]
        send_frame(link, RoomDone(aux))  # behind the pages on the same ordered link
        return nbytes

    def write_share(self, peer: PeerRegistration, link: socket.socket | None, room: int,
                    src_pages: list[int], dst_pages: list[int], share: Share) -> int:
        assert link is not None  # (uses_links)
        src = torch.tensor(src_pages, dtype=torch.int64, device=self.pool.device)
        part = head_slice(self.pool.buffer.index_select(0, src), self.held, share)
        raw = part.contiguous().cpu().view(torch.uint8)
        send_frame(link, PagesFrame(room, dst_pages, raw.numel(), [share.src, share.lo, share.hi]))
        send_views(link, [memoryview(raw.numpy()).cast("B")])  # type: ignore[arg-type]
        return raw.numel()

    def write_done(self, peer: PeerRegistration, link: socket.socket | None,
                   aux: AuxRecord) -> None:
        assert link is not None  # (uses_links)
        send_frame(link, RoomDone(aux))  # behind rank 0's share on the same ordered link

    def read_pages(self, frame: PagesFrame, link: socket.socket, peer: str) -> bool:
        if frame.share is not None:
            return self._read_share(frame, link, peer)
        n = len(frame.dst_pages)
        page_bytes = self.pool.page_bytes
        if n > self.pool.num_pages or frame.nbytes != n * page_bytes:
            raise TransferError(f"room {frame.room}: {frame.nbytes} bytes for {n} pages of "
                                f"{page_bytes} bytes (a pool of {self.pool.num_pages} pages)")
        if not self.fence.admit(frame.room, frame.dst_pages, peer):
            skip(link, frame.nbytes)  # not this room's pages, or not now: they land nowhere
            return False
        complete = False
        try:
            if self.on_cpu:
                recv_views(link, page_views(self.rows, frame.dst_pages))
            else:
                staging = torch.empty((n, page_bytes), dtype=torch.uint8)
                dst = torch.tensor(frame.dst_pages, dtype=torch.int64, device=self.rows.device)
                recv_views(link, [memoryview(staging.numpy()).cast("B")])  # type: ignore[arg-type]
                self.rows.index_copy_(0, dst, staging.to(self.rows.device))
            complete = True
        finally:
            self.fence.landed(frame.room, complete)
        return True

    def _read_share(self, frame: PagesFrame, link: socket.socket, peer: str) -> bool:
        """A share of the room's KV heads (tensor parallelism: runtime/disagg/shares.py) into
        the same heads of this rank's pages, through host staging."""
        assert frame.share is not None
        src, lo, hi = frame.share
        n, (first, last) = len(frame.dst_pages), self.held
        if not first <= lo < hi <= last or n > self.pool.num_pages \
                or frame.nbytes != n * (hi - lo) * self.layout.head_bytes:
            raise TransferError(f"room {frame.room}: {frame.nbytes} bytes of KV heads [{lo}, {hi}) "
                                f"for {n} pages; this rank holds heads [{first}, {last})")
        if not self.fence.admit(frame.room, frame.dst_pages, peer, src):
            skip(link, frame.nbytes)
            return False
        complete = False
        try:
            pool = self.pool
            staging = torch.empty(frame.nbytes, dtype=torch.uint8)
            recv_views(link, [memoryview(staging.numpy()).cast("B")])  # type: ignore[arg-type]
            part = staging.view(pool.dtype).view(n, pool.num_layers, 2, pool.page_size, hi - lo,
                                                 pool.head_dim)
            dst = torch.tensor(frame.dst_pages, dtype=torch.int64, device=pool.device)
            pool.buffer[dst, :, :, :, lo - first:hi - first] = part.to(pool.device)
            complete = True
        finally:
            self.fence.landed(frame.room, complete, src)
        return True

    def read_done(self, aux: AuxRecord, peer: str) -> bool:
        # its pages came first on this link: it counts only if they were admitted and complete
        return self.fence.arrive(aux, peer, written=True)
