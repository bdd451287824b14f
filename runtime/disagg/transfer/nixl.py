"""nixl backend: the prefill WRITEs pages straight into the decode pool over UCX.

Both sides register every pool buffer once and describe it as blocks of one page; a transfer is
a prepared WRITE of block indices `buffer * num_pages + page` (nixl merges adjacent blocks),
with the room id as its notification. The decode side counts a room landed when that
notification arrives (the prefill also sends RoomDone on the link after the WRITE completes).
Host memory (DRAM) on CPU, device memory (VRAM) where the pool is on a GPU.
"""

from __future__ import annotations

import base64
import socket
import threading
import time
from typing import Any

from nixl._api import nixl_agent, nixl_agent_config

from runtime.disagg.transfer.base import KVTransfer, TransferError
from runtime.kvcache.pool import KVPool

WRITE_TIMEOUT_S = 60.0


def _mem_type(pool: KVPool) -> tuple[str, int]:
    dev = pool.k[0].device
    return ("VRAM", dev.index or 0) if dev.type == "cuda" else ("DRAM", 0)


class NixlTransfer(KVTransfer):
    name = "nixl"

    def __init__(self, pool: KVPool, agent_name: str) -> None:
        super().__init__(pool, agent_name)
        self.mem, self.dev = _mem_type(pool)
        self.agent = nixl_agent(agent_name, nixl_agent_config(backends=["UCX"]))
        self._lock = threading.Lock()  # one caller into the agent at a time
        self.page_bytes = self.layout.page_bytes
        buffers = self.buffers()
        self.agent.register_memory(buffers)
        self.addrs = [b.data_ptr() for b in buffers]
        self.local = self.agent.prep_xfer_dlist("", self._blocks(self.addrs, pool.num_pages), self.mem)
        self.peers: dict[str, tuple[str, Any, int]] = {}  # peer -> (agent, prepped dlist, pages)
        self._landed: set[int] = set()

    def _blocks(self, addrs: list[int], num_pages: int) -> list[tuple[int, int, int]]:
        pb = self.page_bytes
        return [(a + p * pb, pb, self.dev) for a in addrs for p in range(num_pages)]

    def local_info(self) -> dict[str, Any]:
        metadata = self.agent.get_agent_metadata()
        return {"agent": self.agent_name, "metadata": base64.b64encode(metadata).decode(),
                "addrs": self.addrs, "num_pages": self.pool.num_pages, "mem": self.mem,
                "dev": self.dev}

    def connect(self, peer_id: str, info: dict[str, Any]) -> None:
        try:
            with self._lock:
                name = self.agent.add_remote_agent(base64.b64decode(info["metadata"]))
                blocks = [(a + p * self.page_bytes, self.page_bytes, int(info["dev"]))
                          for a in info["addrs"] for p in range(int(info["num_pages"]))]
                remote = self.agent.prep_xfer_dlist(name, blocks, info["mem"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise TransferError(f"nixl: cannot connect to peer {peer_id}: {e}") from e
        self.peers[peer_id] = (name, remote, int(info["num_pages"]))

    def forget(self, peer_id: str) -> None:
        peer = self.peers.pop(peer_id, None)
        if peer is not None:
            with self._lock:
                self.agent.release_dlist_handle(peer[1])
                self.agent.remove_remote_agent(peer[0])

    def write(
        self, peer_id: str, link: socket.socket, room: int, src_pages: list[int], dst_pages: list[int]
    ) -> int:
        if peer_id not in self.peers:
            raise TransferError(f"nixl: peer {peer_id} is not connected")
        _, remote, remote_pages = self.peers[peer_id]
        n_buf = len(self.addrs)
        local_idx = [b * self.pool.num_pages + p for b in range(n_buf) for p in src_pages]
        remote_idx = [b * remote_pages + p for b in range(n_buf) for p in dst_pages]
        with self._lock:
            handle = self.agent.make_prepped_xfer(
                "WRITE", self.local, local_idx, remote, remote_idx, str(room).encode()
            )
            state = self.agent.transfer(handle)
        try:
            self._wait(handle, state, room)
        finally:
            with self._lock:
                self.agent.release_xfer_handle(handle)
        return len(local_idx) * self.page_bytes

    def _wait(self, handle: Any, state: str, room: int) -> None:
        deadline = time.monotonic() + WRITE_TIMEOUT_S
        while state != "DONE":
            if state == "ERR":
                raise TransferError(f"nixl WRITE for room {room} failed")
            if time.monotonic() > deadline:
                raise TransferError(f"nixl WRITE for room {room} not done in {WRITE_TIMEOUT_S} s")
            time.sleep(0.0002)
            with self._lock:
                state = self.agent.check_xfer_state(handle)

    def landed(self, room: int) -> bool:
        with self._lock:
            notifs = self.agent.get_new_notifs()
        for messages in notifs.values():
            for msg in messages:
                if msg.isdigit():
                    self._landed.add(int(msg))
        return room in self._landed

    def discard(self, room: int) -> None:
        self._landed.discard(room)

    def close(self) -> None:
        for peer in list(self.peers):
            self.forget(peer)
