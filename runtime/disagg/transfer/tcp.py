"""tcp backend: pages streamed over the prefill->decode link itself.

The sender gathers the room's pages of each buffer into one block and sends it after a
PagesFrame header; the receiver reads each block into a staging buffer and scatters it into its
own pages. The fallback where nixl is missing, and the simplest thing that can be right.
"""

from __future__ import annotations

import socket
import threading

import torch

from runtime.disagg.transfer.base import KVTransfer, TransferError
from runtime.disagg.wire import PagesFrame, recv_into_exact, send_frame
from runtime.kvcache.pool import KVPool


class TcpTransfer(KVTransfer):
    name = "tcp"

    def __init__(self, pool: KVPool, agent_name: str) -> None:
        super().__init__(pool, agent_name)
        self.views = self.page_views()  # [num_pages, page_bytes] uint8 per buffer
        self._landed: set[int] = set()
        self._lock = threading.Lock()

    def write(
        self, peer_id: str, link: socket.socket, room: int, src_pages: list[int], dst_pages: list[int]
    ) -> int:
        src = torch.tensor(src_pages, dtype=torch.int64, device=self.views[0].device)
        # [n_pages, page_bytes] per buffer; .cpu() is a no-op for a CPU pool
        blocks = [v.index_select(0, src).cpu() for v in self.views]
        nbytes = sum(b.numel() for b in blocks)
        payload = [memoryview(b.numpy()) for b in blocks]  # type: ignore[arg-type]
        send_frame(link, PagesFrame(room, dst_pages, nbytes), payload)
        return nbytes

    def read_pages(self, frame: PagesFrame, link: socket.socket) -> None:
        n = len(frame.dst_pages)
        page_bytes = self.views[0].shape[1]
        if frame.nbytes != n * page_bytes * len(self.views):
            raise TransferError(f"room {frame.room}: {frame.nbytes} bytes for {n} pages of "
                                f"{page_bytes} x {len(self.views)} buffers")
        if n and max(frame.dst_pages) >= self.pool.num_pages:
            raise TransferError(f"room {frame.room}: page index out of range")
        dst = torch.tensor(frame.dst_pages, dtype=torch.int64, device=self.views[0].device)
        staging = torch.empty((n, page_bytes), dtype=torch.uint8)
        for view in self.views:
            recv_into_exact(link, memoryview(staging.numpy()).cast("B"))  # type: ignore[arg-type]
            view.index_copy_(0, dst, staging.to(view.device))
        with self._lock:
            self._landed.add(frame.room)

    def landed(self, room: int) -> bool:
        with self._lock:
            return room in self._landed

    def discard(self, room: int) -> None:
        with self._lock:
            self._landed.discard(room)
