"""nixl backend: the prefill WRITEs pages straight into the decode pool over UCX.

Both sides register their pool's buffer once. A transfer is one WRITE whose descriptors are the
room's runs of pages that are adjacent on both sides (the pool is page-major, so a run of n
pages is one block of n pages' bytes, every layer's K and V: UCX pays per descriptor, ~10 us
each with cma on loopback). Its notification is the room's aux record (msgpack), which nixl
delivers only after the WRITE's data: the decode side has the first token the moment the KV is
in place, with nothing on the TCP link (that carries only RoomFailed).

Progress: nixl's own progress thread (pthrDelay 0, not settable from Python) kept a core busy
in every process with a connected peer, idle or not; on a 2-core host that made PD decode ~1.8x
slower per token. So the agent runs without it: the prefill progresses its WRITE by polling its
state, and the decode progresses only while its fence expects KV (`WriteFence.expect(room)`
until it arrived), from a small thread that polls notifications every PROGRESS_S and hands the
aux records to the fence (`arrive`, which wakes the scheduler loop).
Host memory (DRAM) on CPU, device memory (VRAM) where the pool is on a GPU.
"""

from __future__ import annotations

import base64
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config

from runtime.device import bind_thread
from runtime.disagg.fence import WriteFence
from runtime.disagg.transfer.base import KVTransfer, TransferError, WriteInDoubt
from runtime.disagg.wire import FRAMES, AuxRecord, KVLayout
from runtime.kvcache.pool import KVPool

log = logging.getLogger(__name__)

WRITE_TIMEOUT_S = 60.0
PROGRESS_S = 0.0005  # decode side: poll for notifications this often while a room is expected
IDLE_WAIT_S = 0.25  # with none expected: how long the progress thread sleeps between looks


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
    one_sided = True  # the prefill WRITEs into our pool: we cannot refuse a write at our door

    def __init__(self, pool: KVPool, agent_name: str, fence: WriteFence | None = None,
                 layout: KVLayout | None = None, rank: int = 0) -> None:
        super().__init__(pool, agent_name, fence, layout, rank)
        self.mem, self.dev = _mem_type(pool)
        self.agent = nixl_agent(agent_name, nixl_agent_config(enable_prog_thread=False,
                                                              backends=["UCX"]))
        self._lock = threading.Lock()  # one caller into the agent at a time
        self.page_bytes = pool.page_bytes
        self.agent.register_memory([pool.buffer])
        self.addr = pool.buffer.data_ptr()
        self.peers: dict[str, _Peer] = {}
        self._closed = False
        self._progress = threading.Thread(target=self._progress_loop, name="nixl-progress",
                                          daemon=True)
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
        return {"agent": self.agent_name, "metadata": base64.b64encode(metadata).decode(),
                "addr": self.addr, "num_pages": self.pool.num_pages, "mem": self.mem,
                "dev": self.dev}

    def connect(self, peer_id: str, info: dict[str, Any]) -> None:
        # NOTE: UCX picks cuda_ipc for VRAM only where the calling thread has a current CUDA
        # context; connect, write and the progress loop run on threads of their own
        bind_thread(self.pool.device)
        try:
            peer = _Peer("", int(info["addr"]), int(info["num_pages"]), str(info["mem"]),
                         int(info["dev"]))
            with self._lock:
                peer.agent = self.agent.add_remote_agent(base64.b64decode(info["metadata"]))
                self.agent.make_connection(peer.agent)  # UCX wire-up now, not in the first WRITE
        except Exception as e:  # a peer's word: malformed, or metadata nixl refuses (its own
            # error types, e.g. nixlMismatchError, derive from Exception only)
            raise TransferError(f"nixl: cannot connect to peer {peer_id}: "
                                f"{type(e).__name__}: {e}") from e
        self.peers[peer_id] = peer

    def forget(self, peer_id: str) -> None:
        peer = self.peers.pop(peer_id, None)
        if peer is not None:
            with self._lock:
                self.agent.remove_remote_agent(peer.agent)

    def write(self, peer_id: str, link: socket.socket, src_pages: list[int], dst_pages: list[int],
              aux: AuxRecord) -> int:
        if peer_id not in self.peers:
            raise TransferError(f"nixl: peer {peer_id} is not connected")
        bind_thread(self.pool.device)
        peer, room, notif = self.peers[peer_id], aux.room, FRAMES.encode(aux)
        if dst_pages and not 0 <= min(dst_pages) <= max(dst_pages) < peer.num_pages:
            raise TransferError(f"room {room}: page index out of range for peer {peer_id}")
        src_at, dst_at, pages = paired_runs(src_pages, dst_pages)
        if not len(pages):
            with self._lock:
                self.agent.send_notif(peer.agent, notif)
            return 0
        with self._lock:
            local = self.agent.get_xfer_descs(self._descs(self.addr, self.dev, src_at, pages), self.mem)
            remote = self.agent.get_xfer_descs(self._descs(peer.addr, peer.dev, dst_at, pages), peer.mem)
            handle = self.agent.initialize_xfer("WRITE", local, remote, peer.agent, notif)
            state = self.agent.transfer(handle)
        try:
            self._wait(handle, state, room)
        finally:
            with self._lock:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception as e:
                    log.warning("nixl: releasing the WRITE of room %d: %s", room, e)
        return len(src_pages) * self.page_bytes

    def _wait(self, handle: Any, state: str, room: int) -> None:
        deadline = time.monotonic() + WRITE_TIMEOUT_S
        while state != "DONE":
            if state == "ERR":
                raise TransferError(f"nixl WRITE for room {room} failed")
            if time.monotonic() > deadline:  # releasing the handle tries to call it off
                raise WriteInDoubt(f"nixl WRITE for room {room} not done in {WRITE_TIMEOUT_S} s")
            time.sleep(0.0002)
            with self._lock:
                state = self.agent.check_xfer_state(handle)

    def _progress_loop(self) -> None:
        bind_thread(self.pool.device)
        while not self._closed:
            if not self.fence.expecting(IDLE_WAIT_S):
                continue
            self._poll()
            time.sleep(PROGRESS_S)

    def _poll(self) -> None:
        """Progress the agent and take the notifications: aux records of rooms whose WRITE
        completed."""
        with self._lock:
            notifs = self.agent.get_new_notifs()
        for agent, messages in notifs.items():
            for msg in messages:
                try:
                    aux = FRAMES.decode(msg)
                except ValueError as e:
                    log.error("nixl: a notification from %s is no aux record: %s", agent, e)
                    continue
                if isinstance(aux, AuxRecord):
                    self.fence.arrive(aux, agent)  # the sender's agent name is its instance id

    def close(self) -> None:
        self._closed = True
        self._progress.join(2)
        for peer in list(self.peers):
            self.forget(peer)
