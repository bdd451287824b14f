"""nixl backend: the prefill WRITEs pages straight into the decode pool over UCX.

Both sides register their pool's buffer once. A transfer is one WRITE whose descriptors are the
room's runs of pages that are adjacent on both sides (the pool is page-major, so a run of n
pages is one block of n pages' bytes, every layer's K and V: UCX pays per descriptor, ~10 us
each with cma on loopback). Its notification is the room's aux record (msgpack), which nixl
delivers only after the WRITE's data: the decode side has the first token the moment the KV is
in place, with nothing on the TCP link (that carries only RoomFailed).

Tensor parallelism (runtime/disagg/shares.py): each rank has an agent of its own over its own
pool, named by the server's instance id and, past rank 0, `#rank` (so a notification names the
prefill and the rank that wrote). A decode's registration carries every rank's agent
(`PeerRegistration.rank_info`); a prefill rank connects to a decode rank the first time it
writes there. A share is one WRITE into its decode rank, whose notification is the share's
`PagesFrame` header ([src rank, lo, hi] and the pages): that rank's fence counts it as the
share landed (`admit` then `landed`, as tcp does around its bytes). Where the share is every
head both ranks hold (equal TP), its descriptors are page runs as above; else a head range of
a page is one run per (layer, K/V, token) on each side (`shares.head_rows`): 2 x layers x
page_size descriptors a page (960 for the builtin model's 30 layers and 16-token pages) where
equal TP needs at most one. A head-major pool ([heads, pages, layers, K/V, tokens, dim]) would
make a head range of a run of pages one block again. Once every rank's WRITEs are DONE (nixl
completes a WRITE with a notification only once its data is at the target), rank 0 sends the
room's aux record as a notification of its own to decode rank 0 (`write_done`): it may come
before the shares' notifications, and waits for them in the fence.

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
from runtime.disagg.shares import Share, Split, head_rows, whole
from runtime.disagg.transfer.base import KVTransfer, TransferError, WriteInDoubt
from runtime.disagg.wire import FRAMES, AuxRecord, KVLayout, PagesFrame, PeerRegistration
from runtime.kvcache.pool import KVPool

log = logging.getLogger(__name__)

WRITE_TIMEOUT_S = 60.0
PROGRESS_S = 0.0005  # decode side: poll for notifications this often while a room is expected
IDLE_WAIT_S = 0.25  # with none expected: how long the progress thread sleeps between looks
RANK_SEP = "#"  # a rank past 0's agent: f"{instance id}#{rank}"


def rank_agent(instance: str, rank: int) -> str:
    return instance if rank == 0 else f"{instance}{RANK_SEP}{rank}"


def agent_rank(agent: str) -> tuple[str, int] | None:
    """(instance id, rank) of a peer's agent name; None when it is no name of ours."""
    instance, sep, rank = agent.rpartition(RANK_SEP)
    if not sep:
        return agent, 0
    return (instance, int(rank)) if rank.isdigit() and int(rank) > 0 else None


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


def _rows(addr: int, dev: int, starts: np.ndarray, nbytes: np.ndarray | int) -> np.ndarray:
    """Nx3 (address, bytes, device) descriptor rows of runs at byte offsets `starts`."""
    rows = np.empty((len(starts), 3), dtype=np.int64)
    rows[:, 0] = addr + starts
    rows[:, 1] = nbytes
    rows[:, 2] = dev
    return rows


class NixlTransfer(KVTransfer):
    name = "nixl"
    one_sided = True  # the prefill WRITEs into our pool: we cannot refuse a write at our door
    uses_links = False  # shares go as WRITEs; the link carries RoomFailed only

    def __init__(self, pool: KVPool, agent_name: str, fence: WriteFence | None = None,
                 layout: KVLayout | None = None, rank: int = 0) -> None:
        super().__init__(pool, agent_name, fence, layout, rank)
        self.mem, self.dev = _mem_type(pool)
        self.agent = nixl_agent(rank_agent(agent_name, rank),
                                nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._lock = threading.Lock()  # one caller into the agent at a time
        self._connecting = threading.RLock()  # peers: writers connect on demand
        self.page_bytes = pool.page_bytes
        self.agent.register_memory([pool.buffer])
        self.addr = pool.buffer.data_ptr()
        self.peers: dict[tuple[str, int], _Peer] = {}  # (decode id, its rank) -> its agent
        self._closed = False
        self._progress = threading.Thread(target=self._progress_loop, name="nixl-progress",
                                          daemon=True)
        self._progress.start()

    def _descs(self, addr: int, dev: int, starts: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """Nx3 (address, bytes, device) rows: one per run of pages."""
        return _rows(addr, dev, starts * self.page_bytes, pages * self.page_bytes)

    def local_info(self) -> dict[str, Any]:
        metadata = self.agent.get_agent_metadata()
        return {"agent": self.agent_name, "metadata": base64.b64encode(metadata).decode(),
                "addr": self.addr, "num_pages": self.pool.num_pages, "mem": self.mem,
                "dev": self.dev}

    def connect(self, peer_id: str, info: dict[str, Any], rank: int = 0) -> None:
        """Connect to decode `peer_id`'s rank `rank` (its agent, from its `local_info`)."""
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
        with self._connecting:
            self.peers[peer_id, rank] = peer

    def _reach(self, peer: PeerRegistration, rank: int) -> _Peer:
        """Decode rank `rank` of `peer`, connected on first use."""
        with self._connecting:
            if (peer.decode_id, rank) not in self.peers:
                try:
                    info = peer.info(rank)
                except (ValueError, IndexError) as e:
                    raise TransferError(f"nixl: {e}") from e
                self.connect(peer.decode_id, info, rank)
            return self.peers[peer.decode_id, rank]

    def forget(self, peer_id: str) -> None:
        with self._connecting:
            gone = [self.peers.pop(key) for key in list(self.peers) if key[0] == peer_id]
        for peer in gone:
            with self._lock:
                self.agent.remove_remote_agent(peer.agent)

    def write(self, peer_id: str, link: socket.socket, src_pages: list[int], dst_pages: list[int],
              aux: AuxRecord) -> int:
        peer = self.peers.get((peer_id, 0))
        if peer is None:
            raise TransferError(f"nixl: peer {peer_id} is not connected")
        room, notif = aux.room, FRAMES.encode(aux)
        _check_pages(peer, peer_id, room, dst_pages)
        src_at, dst_at, pages = paired_runs(src_pages, dst_pages)
        if not len(pages):
            self._notify(peer, notif)
            return 0
        self._xfer(peer, room, notif, self._descs(self.addr, self.dev, src_at, pages),
                   self._descs(peer.addr, peer.dev, dst_at, pages))
        return len(src_pages) * self.page_bytes

    def write_share(self, peer: PeerRegistration, link: socket.socket | None, room: int,
                    src_pages: list[int], dst_pages: list[int], share: Share) -> int:
        to = self._reach(peer, share.dst)
        _check_pages(to, peer.decode_id, room, dst_pages)
        theirs = Split(peer.kv_layout.tp_size, self.layout.num_kv_heads).held(share.dst)
        nbytes = len(src_pages) * share.heads * self.layout.head_bytes
        notif = FRAMES.encode(PagesFrame(room, dst_pages, nbytes, [share.src, share.lo, share.hi]))
        if not src_pages:
            self._notify(to, notif)
        elif whole(share, self.held, theirs):  # every head on both sides: runs of pages
            src_at, dst_at, pages = paired_runs(src_pages, dst_pages)
            self._xfer(to, room, notif, self._descs(self.addr, self.dev, src_at, pages),
                       self._descs(to.addr, to.dev, dst_at, pages))
        else:  # a head range: one descriptor per (page, layer, K/V, token) row on each side
            mine, size = head_rows(np.asarray(src_pages), self.held, share, self.layout)
            there, _ = head_rows(np.asarray(dst_pages), theirs, share, self.layout)
            self._xfer(to, room, notif, _rows(self.addr, self.dev, mine, size),
                       _rows(to.addr, to.dev, there, size))
        return nbytes

    def write_done(self, peer: PeerRegistration, link: socket.socket | None,
                   aux: AuxRecord) -> None:
        self._notify(self._reach(peer, 0), FRAMES.encode(aux))

    def _notify(self, peer: _Peer, notif: bytes) -> None:
        bind_thread(self.pool.device)
        with self._lock:
            self.agent.send_notif(peer.agent, notif)

    def _xfer(self, peer: _Peer, room: int, notif: bytes, local_rows: np.ndarray,
              remote_rows: np.ndarray) -> None:
        """One WRITE of the local rows into the peer's, `notif` delivered behind its data."""
        bind_thread(self.pool.device)
        with self._lock:
            local = self.agent.get_xfer_descs(local_rows, self.mem)
            remote = self.agent.get_xfer_descs(remote_rows, peer.mem)
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
        """Progress the agent and take the notifications: a share's header once its WRITE
        completed, a room's aux record (a whole room's WRITE, or every share's) after that."""
        with self._lock:
            notifs = self.agent.get_new_notifs()
        for agent, messages in notifs.items():
            sender = agent_rank(agent)
            for msg in messages:
                try:
                    word = FRAMES.decode(msg)
                except ValueError as e:
                    log.error("nixl: a notification from %s is no frame of ours: %s", agent, e)
                    continue
                if sender is None:
                    log.error("nixl: a notification from %s, no agent of ours", agent)
                elif isinstance(word, AuxRecord) and sender[1] == 0:
                    self.fence.arrive(word, sender[0])  # rank 0's agent name is its instance id
                elif isinstance(word, PagesFrame) and word.share is not None:
                    self._landed(word, *sender)
                else:
                    log.error("nixl: %s sent a %s, which it may not", agent, type(word).__name__)

    def _landed(self, frame: PagesFrame, peer: str, rank: int) -> None:
        """A share's WRITE is over: the fence counts it if the room admits it (its bytes are
        in our pages either way: only a room's own prefill knows them)."""
        assert frame.share is not None
        src, lo, hi = frame.share
        first, last = self.held
        if src != rank or not first <= lo < hi <= last \
                or frame.nbytes != len(frame.dst_pages) * (hi - lo) * self.layout.head_bytes:
            log.error("nixl: room %d: a share [%d, %d) of rank %d from %s rank %d, this rank "
                      "holds heads [%d, %d)", frame.room, lo, hi, src, peer, rank, first, last)
        elif self.fence.admit(frame.room, frame.dst_pages, peer, src):
            self.fence.landed(frame.room, True, src)
        else:
            log.warning("nixl: room %d: a share from %s rank %d it does not admit now",
                        frame.room, peer, rank)

    def close(self) -> None:
        self._closed = True
        self._progress.join(2)
        for peer in {key[0] for key in self.peers}:
            self.forget(peer)


def _check_pages(peer: _Peer, peer_id: str, room: int, dst_pages: list[int]) -> None:
    if dst_pages and not 0 <= min(dst_pages) <= max(dst_pages) < peer.num_pages:
        raise TransferError(f"room {room}: page index out of range for peer {peer_id}")
