"""The prefill server's KV sender: links to decode receivers and transfers on worker threads.

One TCP link per decode server, opened on first use and reused; a transfer holds its link for
the pages and the RoomDone that follows them (tcp backend), so a room's frames are never
interleaved with another's; RoomFailed frames travel on it for every backend. A new link first
runs the handshake (handshake.py): nothing is sent to a listener that does not prove it is the
registered decode with our cluster key. A link that fails is dropped and the next transfer
reconnects (a decode that restarted on the same address is found again). Each write first
`claim`s its room (the prefill role refuses a cancelled or expired one); `close` waits for the
writes under way (up to CLOSE_WAIT_S) so none outlives the role.
When either side has several TP ranks (runtime/disagg/shares.py), a room moves as shares: each
prefill rank writes its KV heads to the decode ranks that hold them, on a link per decode rank
(`write_shares`; rank 0 has its followers write theirs through `ranks`,
runtime/disagg/ranks_plane.py), and the RoomDone follows on rank 0's link once all are written.
A one-sided backend (nixl) writes its shares and the RoomDone its own way (WRITEs and their
notifications, no bytes on our links): a decode's agents reach a prefill only through the
signed registration, and the link still carries RoomFailed.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass

from runtime.auth.key import ClusterKey
from runtime.disagg.handshake import open_link
from runtime.disagg.interfaces import RankCalls
from runtime.disagg.shares import Share, Split, plan
from runtime.disagg.transfer.base import KVTransfer, TransferError, WriteInDoubt
from runtime.disagg.wire import AuxRecord, PeerRegistration, RoomFailed, send_frame

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
SEND_TIMEOUT_S = 60.0
CLOSE_WAIT_S = 10.0
# a link's handshake that a receiver flooded with unproven connections closed: again, after
# 0.1, 0.2, 0.4 and 0.8 s (1.5 s in all: past a burst of newcomers younger than the receiver's
# MIN_WAIT_S, which it cannot close to make room)
LINK_TRIES, LINK_BACKOFF_S = 5, 0.1


@dataclass
class Sent:
    room: int
    nbytes: int
    seconds: float


@dataclass
class _Link:
    sock: socket.socket
    lock: threading.Lock
    dropped: bool = False  # a write on it failed and closed it


class KVSender:
    def __init__(self, transfer: KVTransfer, key: ClusterKey, workers: int = 2,
                 ranks: RankCalls | None = None) -> None:
        """`ranks`: rank 0's followers, when this server has several TP ranks."""
        self.transfer, self.key, self.ranks = transfer, key, ranks
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="kv-sender")
        self.links: dict[tuple[str, int], _Link] = {}  # (decode id, its rank) -> link
        self._lock = threading.Lock()
        self._idle = threading.Condition()
        self._writing = 0

    def send(
        self, peer: PeerRegistration, src_pages: list[int], dst_pages: list[int], aux: AuxRecord,
        claim: Callable[[], None],
    ) -> Future[Sent]:
        """Write the room's pages into the decode's, with its aux record behind them, once
        `claim()` allowed it (it raises TransferError otherwise); the future fails with
        TransferError or OSError when the decode cannot be reached or the write fails."""
        return self.pool.submit(self._send, peer, src_pages, dst_pages, aux, claim)

    def fail(self, peer: PeerRegistration, room: int, reason: str) -> None:
        """Tell a decode server that a room it registered will never get KV (best effort)."""
        self.pool.submit(self._notify, peer, RoomFailed(room, reason))

    def _send(
        self, peer: PeerRegistration, src_pages: list[int], dst_pages: list[int], aux: AuxRecord,
        claim: Callable[[], None],
    ) -> Sent:
        began = time.monotonic()
        link = self._link(peer)
        with self._idle:
            self._writing += 1
        try:
            with link.lock:
                if link.dropped:  # another write failed on it while this one waited
                    raise TransferError(f"the KV link to decode {peer.decode_id} is broken: "
                                        "a write on it failed while this one waited")
                claim()  # raises when the room must not be written (the link is fine)
                nbytes = self._write(peer, link, src_pages, dst_pages, aux)
        finally:
            with self._idle:
                self._writing -= 1
                self._idle.notify_all()
        return Sent(aux.room, nbytes, time.monotonic() - began)

    def _write(self, peer: PeerRegistration, link: _Link, src_pages: list[int],
               dst_pages: list[int], aux: AuxRecord) -> int:
        try:
            if self.transfer.layout.tp_size == 1 and peer.kv_layout.tp_size == 1:
                return self.transfer.write(peer.decode_id, link.sock, src_pages, dst_pages, aux)
            return self._write_ranks(peer, link, src_pages, dst_pages, aux)
        except (OSError, TransferError):
            self._drop((peer.decode_id, 0), link)
            raise

    def _write_ranks(self, peer: PeerRegistration, link: _Link, src_pages: list[int],
                     dst_pages: list[int], aux: AuxRecord) -> int:
        """Every rank's shares of the room, then its RoomDone to decode rank 0 (on its link,
        held). A one-sided backend's write that did not end (it timed out there, or its rank
        did not answer in time) may still land: the room's write is then in doubt."""
        layout = peer.kv_layout
        shares = plan(self.transfer.split, Split(layout.tp_size, layout.num_kv_heads))
        writers = sorted({s.src for s in shares} - {0})
        assert self.ranks is not None or not writers
        calls = {r: self.ranks.call(r, "write", aux.room, asdict(peer), src_pages, dst_pages,  # type: ignore[union-attr]
                                    [s for s in shares if s.src == r]) for r in writers}
        error: BaseException | None = None
        try:
            nbytes = self.write_shares(peer, aux.room, src_pages, dst_pages,
                                       [s for s in shares if s.src == 0], link)
        except (OSError, TransferError) as e:
            error, nbytes = e, 0
        nbytes, error = self._wait_ranks(calls, nbytes, error)
        if error is not None:
            raise error
        self.transfer.write_done(peer, link.sock, aux)  # the others' shares are written
        return nbytes

    def _wait_ranks(self, calls: dict[int, Future[int]], nbytes: int,
                    error: BaseException | None) -> tuple[int, BaseException | None]:
        """Every rank's write is over (or in doubt) before the room's fate is told: the bytes
        moved in all, and the error to fail the room with (one in doubt wins)."""
        for r, call in calls.items():
            try:
                nbytes += call.result(SEND_TIMEOUT_S)
            except Exception as e:
                doubt = self.transfer.one_sided and _in_doubt(e)
                failed = (WriteInDoubt if doubt else TransferError)(
                    f"prefill TP rank {r} did not write its KV: {e}")
                error = failed if doubt or error is None else error
        return nbytes, error

    def write_shares(self, peer: PeerRegistration, room: int, src_pages: list[int],
                     dst_pages: list[int], shares: list[Share], held: _Link | None = None) -> int:
        """This rank's `shares` of a room, each on its decode rank's link (`held`: rank 0's,
        whose lock the caller holds), or by the backend's own way (`uses_links`). Returns the
        bytes moved."""
        nbytes = 0
        for share in shares:
            if not self.transfer.uses_links or (share.dst == 0 and held is not None):
                sock = held.sock if held is not None and share.dst == 0 else None
                nbytes += self.transfer.write_share(peer, sock, room, src_pages, dst_pages, share)
                continue
            link = self._link(peer, share.dst)
            with link.lock:
                try:
                    nbytes += self.transfer.write_share(peer, link.sock, room, src_pages,
                                                        dst_pages, share)
                except (OSError, TransferError):
                    self._drop((peer.decode_id, share.dst), link)
                    raise
        return nbytes

    def _notify(self, peer: PeerRegistration, frame: RoomFailed) -> None:
        try:
            link = self._link(peer)
            with link.lock:
                send_frame(link.sock, frame)
        except (OSError, TransferError) as e:
            log.info("could not tell %s that room %d failed: %s", peer.decode_id, frame.room, e)

    def _link(self, peer: PeerRegistration, rank: int = 0) -> _Link:
        """The link to decode rank `rank` of `peer` (opened and proven on first use)."""
        key = (peer.decode_id, rank)
        with self._lock:
            link = self.links.get(key)
        if link is not None:
            return link
        sock = self._open(peer, rank)
        with self._lock:
            link = self.links.setdefault(key, _Link(sock, threading.Lock()))
        if link.sock is not sock:
            sock.close()
        return link

    def _open(self, peer: PeerRegistration, rank: int) -> socket.socket:
        """A new link to `peer`'s rank `rank`, proven. A receiver under a flood of unproven
        connections may close ours to make room (runtime/disagg/receiver.py): tried LINK_TRIES
        times."""
        addr = peer.receiver(rank)
        for attempt in range(1, LINK_TRIES + 1):
            try:
                sock = socket.create_connection(addr, timeout=CONNECT_TIMEOUT_S)
            except OSError as e:
                raise TransferError(f"cannot reach decode {peer.decode_id} at {addr}: {e}") from e
            sock.settimeout(SEND_TIMEOUT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                open_link(sock, self.key, self.transfer.agent_name, peer.decode_id)
                return sock
            except OSError as e:
                sock.close()
                if attempt == LINK_TRIES:
                    raise TransferError(f"decode {peer.decode_id} at {addr}: {e}") from e
                backoff = LINK_BACKOFF_S * 2 ** (attempt - 1)
                log.info("KV link to %s at %s: %s; again in %.1f s", peer.decode_id, addr, e, backoff)
                time.sleep(backoff)
        raise AssertionError("unreachable")

    def _drop(self, key: tuple[str, int], link: _Link) -> None:
        link.dropped = True
        with self._lock:
            if self.links.get(key) is link:
                del self.links[key]
        link.sock.close()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self._idle:
            self._idle.wait_for(lambda: self._writing == 0, CLOSE_WAIT_S)
        with self._lock:
            links, self.links = list(self.links.values()), {}
        for link in links:
            with contextlib.suppress(OSError):
                link.sock.close()


def _in_doubt(error: BaseException) -> bool:
    """A follower's write that may not be over: it raised WriteInDoubt there (the call's error
    names the kind: runtime/scheduler/ranks.py RankCallError), or gave no answer in time."""
    return isinstance(error, TimeoutError) or getattr(error, "kind", None) == WriteInDoubt.__name__
