"""nixl backend: the prefill WRITEs pages straight into the decode pool over UCX.

Both sides register their pool's buffer once. A transfer is one WRITE whose descriptors are the
room's runs of pages that are adjacent on both sides (the pool is page-major, so a run of n
pages is one block of n pages' bytes, every layer's K and V: UCX pays per descriptor, ~10 us
each with cma on loopback), with the room id as its notification.

Progress: nixl's own progress thread (pthrDelay 0, not settable from Python) kept a core busy
in every process with a connected peer, idle or not; on a 2-core host that made PD decode ~1.8x
slower per token. So the agent runs without it: the prefill progresses its WRITE by polling its
state, and the decode progresses only while it expects KV (`expect(room)` until it landed),
from a small thread that polls notifications every PROGRESS_S. The decode side counts a room
landed when that notification arrives (the prefill also sends RoomDone on the link after the
WRITE completes).
Host memory (DRAM) on CPU, device memory (VRAM) where the pool is on a GPU.
"""

from __future__ import annotations

import base64
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config

from runtime.disagg.transfer.base import KVTransfer, TransferError
from runtime.kvcache.pool import KVPool

WRITE_TIMEOUT_S = 60.0
PROGRESS_S = 0.0005  # decode side: poll for notifications this often while a room is expected


@dataclass
class _Peer:
    agent: str  # its nixl agent name
    addr: int  # its pool buffer
    num_pages: int
    mem: str
    dev: int


def paired_runs(src: list[int], dst: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src starts, dst starts, lengths) of the runs where both sides' pages go up by one."""
    s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    if not len(s):
        return s, d, s
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(s)])))
    return s[starts], d[starts], lengths


def _mem_type(pool: KVPool) -> tuple[str, int]:
    dev = pool.device
    return ("VRAM", dev.index or 0) if dev.type == "cuda" else ("DRAM", 0)


class NixlTransfer(KVTransfer):
    name = "nixl"

    def __init__(self, pool: KVPool, agent_name: str) -> None:
        super().__init__(pool, agent_name)
        self.mem, self.dev = _mem_type(pool)
        self.agent = nixl_agent(
            agent_name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        self._lock = threading.Lock()  # one caller into the agent at a time
        self.page_bytes = self.layout.page_bytes
        self.agent.register_memory([pool.buffer])
        self.addr = pool.buffer.data_ptr()
        self.peers: dict[str, _Peer] = {}
        self._landed: set[int] = set()
        self._expected: set[int] = set()
        self._wake = threading.Event()
        self._closed = False
        self._progress = threading.Thread(
            target=self._progress_loop, name="nixl-progress", daemon=True
        )
        self._progress.start()

    def _descs(self, addr: int, dev: int, starts: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """Nx3 (address, bytes, device) rows: one per run of pages."""
        rows = np.empty((len(starts), 3), dtype=np.int64)
        rows[:, 0] = addr + starts * self.page_bytes
        rows[:, 1] = pages * self.page_bytes
        rows[:, 2] = dev
        return rows

    def local_info(self) -> dict[str, Any]:
        metadata = self.agent.get_agent_metadata()
        return {
            "agent": self.agent_name,
            "metadata": base64.b64encode(metadata).decode(),
            "addr": self.addr,
            "num_pages": self.pool.num_pages,
            "mem": self.mem,
            "dev": self.dev,
        }

    def connect(self, peer_id: str, info: dict[str, Any]) -> None:
        try:
            peer = _Peer(
                "", int(info["addr"]), int(info["num_pages"]), str(info["mem"]), int(info["dev"])
            )
            with self._lock:
                peer.agent = self.agent.add_remote_agent(base64.b64decode(info["metadata"]))
                self.agent.make_connection(peer.agent)  # UCX wire-up now, not in the first WRITE
        except (KeyError, ValueError, RuntimeError) as e:
            raise TransferError(f"nixl: cannot connect to peer {peer_id}: {e}") from e
        self.peers[peer_id] = peer

    def forget(self, peer_id: str) -> None:
        peer = self.peers.pop(peer_id, None)
        if peer is not None:
            with self._lock:
                self.agent.remove_remote_agent(peer.agent)

    def write(
        self,
        peer_id: str,
        link: socket.socket,
        room: int,
        src_pages: list[int],
        dst_pages: list[int],
    ) -> int:
        if peer_id not in self.peers:
            raise TransferError(f"nixl: peer {peer_id} is not connected")
        peer = self.peers[peer_id]
        if dst_pages and not 0 <= min(dst_pages) <= max(dst_pages) < peer.num_pages:
            raise TransferError(f"room {room}: page index out of range for peer {peer_id}")
        src_at, dst_at, pages = paired_runs(src_pages, dst_pages)
        if not len(pages):
            with self._lock:
                self.agent.send_notif(peer.agent, str(room).encode())
            return 0
        with self._lock:
            local = self.agent.get_xfer_descs(
                self._descs(self.addr, self.dev, src_at, pages), self.mem
            )
            remote = self.agent.get_xfer_descs(
                self._descs(peer.addr, peer.dev, dst_at, pages), peer.mem
            )
            handle = self.agent.initialize_xfer(
                "WRITE", local, remote, peer.agent, str(room).encode()
            )
            state = self.agent.transfer(handle)
        try:
            self._wait(handle, state, room)
        finally:
            with self._lock:
                self.agent.release_xfer_handle(handle)
        return len(src_pages) * self.page_bytes

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

    def expect(self, room: int) -> None:
        with self._lock:
            self._expected.add(room)
        self._wake.set()

    def _progress_loop(self) -> None:
        while not self._closed:
            if not self._expected:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            self._poll()
            time.sleep(PROGRESS_S)

    def _poll(self) -> None:
        """Progress the agent and take the notifications (rooms whose WRITE completed)."""
        with self._lock:
            for messages in self.agent.get_new_notifs().values():
                for msg in messages:
                    if msg.isdigit():
                        self._landed.add(int(msg))
                        self._expected.discard(int(msg))

    def landed(self, room: int) -> bool:
        self._poll()
        with self._lock:
            return room in self._landed

    def discard(self, room: int) -> None:
        with self._lock:
            self._landed.discard(room)
            self._expected.discard(room)

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._progress.join(2)
        for peer in list(self.peers):
            self.forget(peer)
