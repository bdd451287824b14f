"""Prefill role: the bootstrap queue and the in-flight transfer queue around the scheduler.

A request (from the router) and its decode server's pages (POST /rooms, from the bootstrap
server's threads) meet in a room, in either order. The request goes to the scheduler as soon as
it arrives: its prefill does not wait for the pages, only its transfer does (so the decode's
registration is off the critical path, and a burst is prefilled together). A room's states and
their table are in runtime/disagg/states.py (`PrefillState`, `PREFILL`):
  BOOTSTRAPPING      one of the two is here; after --bootstrap-timeout-s alone, it fails (a
                     prefilled request's pages are freed then)
  WAITING_FOR_INPUT  both are; once its last prompt chunk is launched the scheduler hands the
                     request here (`take`); its first output token shows the forward that
                     wrote its KV has finished
  QUEUED             its write waits for the sender
  WRITING            the sender claimed it (`_claim`) and writes the pages into the decode pool,
                     then the aux record
  SUCCESS / FAILED   its pages are freed, the request finishes (length / abort); it leaves the
                     table in the same step, under the lock
and its request's stage with the scheduler (`Stage`): PENDING, SCHEDULED (its prefill runs; the
scheduler owns its KV), HANDED_OFF (ours, with its KV). The decode server may cancel a room
(DELETE /rooms): until its write is claimed that is a promise never to write (200): the room
goes to CANCELLED (failed at the next poll) or, with its write queued, CANCELLED_QUEUED (the
claim refuses it); once claimed (WRITING) the write's own answer (the aux record behind the
pages, or a RoomFailed frame) follows (202). The sender claims the room under the same lock just
before it writes: a room cancelled by then, or whose decode stopped waiting (`wait_s` of its
RoomRequest), is never written, however late a frozen or slow prefill gets there. A RoomFailed
frame is sent only once no write for the room is under way (it is the decode's licence to free
the pages); a nixl WRITE that timed out may still land, so its room is remembered as in doubt
(`in_doubt`: the room itself has ended) and a cancel of it is never answered 200.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic

from runtime.auth.signed import CallGate
from runtime.auth.ticket import check_room
from runtime.config import DisaggConfig
from runtime.disagg.bootstrap import BootstrapServer, PeerRejected, UnknownPeer
from runtime.disagg.interfaces import HandoffPort, R, SchedulerPort
from runtime.disagg.plane import KVPlane
from runtime.disagg.rooms import Room, RoomError, RoomInUse, RoomTable, count_states
from runtime.disagg.sender import KVSender, Sent
from runtime.disagg.states import PREFILL, PREFILL_CANCELS, PREFILL_SENDING, STAGE, Stage
from runtime.disagg.states import PrefillState as P
from runtime.disagg.transfer.base import TransferError, WriteInDoubt
from runtime.disagg.wire import AuxRecord, PeerRegistration, RoomRequest
from runtime.kvcache.manager import KVCacheManager
from runtime.messages import DisaggStats

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Room(Generic[R]):
    room: Room[P]  # its state: moved under the role's lock (bootstrap and sender threads move it)
    req: R | None = None
    target: RoomRequest | None = None
    peer: PeerRegistration | None = None
    stage: Stage = Stage.PENDING  # its request with the scheduler (the loop's thread only)
    write_by: float = 0.0  # monotonic: no write may start after this (the decode stops waiting)
    sending: Future[Sent] | None = None  # from QUEUED on: the sender's answer
    undo: Callable[[], None] | None = None  # of a fault injected into its pages before sending
    fence: int | None = None  # adopted: its pages leave once the scheduler passed this KV fence

    @property
    def number(self) -> int:
        return self.room.number

    def to_stage(self, stage: Stage) -> None:
        self.stage = STAGE.move(self.stage, stage)


def _new(number: int) -> _Room[Any]:
    return _Room(Room(number, PREFILL))


@dataclass
class PrefillRole(Generic[R]):
    scheduler: SchedulerPort[R]
    handoffs: HandoffPort[R]  # the scheduler's: what it hands over, the KV fence
    kv: KVCacheManager
    plane: KVPlane  # the server's (a draining decode's mover sends on the decode's)
    sender: KVSender
    config: DisaggConfig
    wake: Callable[[], None]
    stats: DisaggStats = field(default_factory=DisaggStats)

    def __post_init__(self) -> None:
        self.transfer, self.key, self.tally = self.plane.transfer, self.plane.key, self.plane.tally
        self.canary = self.plane.canary  # the KV canary's tags travel with the pages
        self.instance_id = self.plane.name  # /route, the KV link proof, nixl's agent
        self.rooms: RoomTable[_Room[R]] = RoomTable()
        self.peers: dict[str, PeerRegistration] = {}
        self.ready = False  # /route answers once started
        self.bootstrap: BootstrapServer | None = None
        # rooms a decode server cancelled before their request came: room -> when (a late
        # request fails at once instead of waiting out the bootstrap timeout)
        self.cancelled: dict[int, float] = {}
        self.lock = threading.Lock()  # rooms and peers: the loop, bootstrap and sender threads
        self.in_doubt: set[int] = set()  # rooms whose write timed out: it may still land
        self._aborted: list[R] = []

    # ---- the bootstrap server's side (its threads) ----------------------------------------
    def route(self) -> dict[str, Any] | None:
        if not self.ready:
            return None
        return {"instance_id": self.instance_id, "tp": self.transfer.layout.tp_size,
                **self.transfer.describe()}

    def register_peer(self, peer: PeerRegistration) -> dict[str, Any]:
        problem = self.transfer.layout.mismatch(peer.kv_layout)
        if problem:
            raise PeerRejected(f"KV layouts differ (this prefill vs that decode): {problem}")
        if peer.backend != self.transfer.name:
            raise PeerRejected(f"this prefill sends KV with {self.transfer.name!r}, "
                               f"the decode server expects {peer.backend!r} (--kv-transfer)")
        try:
            self.transfer.connect(peer.decode_id, peer.backend_info)
        except TransferError as e:
            raise PeerRejected(str(e)) from e
        address = (peer.receiver_host, peer.receiver_port)
        with self.lock:
            stale = [d for d, p in self.peers.items()  # a decode restarted on the same address
                     if (p.receiver_host, p.receiver_port) == address and d != peer.decode_id]
            for decode_id in stale:
                del self.peers[decode_id]
            self.peers[peer.decode_id] = peer
        ranks = self.plane.ranks
        for decode_id in stale:
            self.transfer.forget(decode_id)
            if ranks is not None:  # (nixl: the agents they connected to)
                for rank in ranks.followers:
                    ranks.call(rank, "forget", decode_id)
        log.info("decode server %s registered (receiver %s:%d)", peer.decode_id,
                 peer.receiver_host, peer.receiver_port)
        return {}  # a decode needs nothing of ours: our pool's address never leaves

    def offer_room(self, request: RoomRequest) -> None:
        check_room(self.key, request.ticket, request.room, request.rid, self.instance_id,
                   request.decode_id)
        with self.lock:
            peer = self.peers.get(request.decode_id)
            if peer is None:
                raise UnknownPeer(request.decode_id)
            r = self.rooms.setdefault(request.room, _new(request.room))
            if r.target is not None:
                raise RoomInUse(f"room {request.room} already has a decode server")
            r.target, r.peer = request, peer
            r.write_by = time.monotonic() + request.wait_s
        self.wake()

    def cancel_room(self, room: int) -> bool:
        """True promises that no write for `room` will happen (none is under way). An ended
        room has left the table under the same lock, so it is never seen here."""
        with self.lock:
            r = self.rooms.get(room)
            if room in self.in_doubt or (r is not None and r.room.state is P.WRITING):
                return False
            if r is not None and r.room.state in PREFILL_CANCELS:
                r.room.move(PREFILL_CANCELS[r.room.state])
        self.wake()
        return True

    def _claim(self, r: _Room[R]) -> None:
        """The sender's thread, just before it writes: raise unless the room may be written."""
        with self.lock:
            if r.room.state is P.CANCELLED_QUEUED:
                raise TransferError("cancelled by the decode server")
            if time.monotonic() > r.write_by:
                raise TransferError(f"the decode server stopped waiting for room {r.number}")
            r.room.move(P.WRITING)

    # ---- the scheduler loop's side -----------------------------------------------------------
    def add(self, req: R) -> None:
        if req.bootstrap_room is None:
            raise RoomError("a prefill server needs bootstrap_room (send requests through "
                            "`baton router`)")
        self.scheduler.validate(req)
        req.hand_off_after_prompt()
        with self.lock:
            r = self.rooms.setdefault(req.bootstrap_room, _new(req.bootstrap_room))
            if r.req is not None:
                raise RoomInUse(f"bootstrap room {req.bootstrap_room} is already in use")
            r.req = req
            if r.room.state is not P.CANCELLED \
                    and self.cancelled.pop(req.bootstrap_room, None) is not None:
                r.room.move(P.CANCELLED)  # its decode cancelled it before it came
            self.rooms.name(req.rid, req.bootstrap_room)

    def adopt(self, req: R, fence: int) -> None:
        """A request whose KV and first token are here already (a draining decode's request,
        split off: runtime/disagg/move.py): its room waits for a decode server to ask for it,
        and its pages leave once every forward launched before `fence` has finished."""
        assert req.bootstrap_room is not None
        with self.lock:
            r = self.rooms.setdefault(req.bootstrap_room, _new(req.bootstrap_room))
            r.req, r.fence = req, fence
            r.to_stage(Stage.HANDED_OFF)
            self.rooms.name(req.rid, req.bootstrap_room)

    def _take_handed_off(self) -> None:
        """Requests the scheduler is done with (prompt KV written, first token sampled): ours
        now, and their KV. One whose room ended meanwhile only has its KV freed."""
        for req in self.handoffs.take_handed_off():
            with self.lock:
                r = self.rooms.find(req.rid)
            if r is not None and r.req is req:
                r.to_stage(Stage.HANDED_OFF)
            else:
                self.kv.release(req)

    def poll(self) -> list[R]:
        """Advance every room; returns the requests that finished (to emit)."""
        touched, self._aborted = self._aborted, []
        self._take_handed_off()
        with self.lock:
            rooms = list(self.rooms.values())
            horizon = time.monotonic() - self.config.bootstrap_timeout_s
            self.cancelled = {k: t for k, t in self.cancelled.items() if t > horizon}
        for r in rooms:
            self._advance(r, touched)
        self.stats.rooms = count_states(r.room for r in self.rooms.values())
        self.stats.count_kv_plane(self.tally.take())
        return touched

    def _advance(self, r: _Room[R], touched: list[R]) -> None:
        if r.room.state is P.CANCELLED:
            self._fail(r, "cancelled by the decode server", touched, "cancelled")
        elif r.stage is Stage.SCHEDULED and r.req is not None and r.req.finished:
            # the scheduler ended it (the KV canary caught its prefill): tell the decode server
            self._fail(r, "the prefill server ended the request before sending its KV", touched,
                       "prefill_error")
        else:
            if r.room.state is P.BOOTSTRAPPING:
                self._bootstrap(r, touched)  # may find the pages of a request prefilled already
            self._transfer(r, touched)

    def _transfer(self, r: _Room[R], touched: list[R]) -> None:
        state = r.room.state
        if state is P.WAITING_FOR_INPUT and self._ready(r):
            self._start_transfer(r)
        elif state in PREFILL_SENDING and r.sending is not None and r.sending.done():
            self._finish_transfer(r, r.sending, touched)

    def _ready(self, r: _Room[R]) -> bool:
        """Its KV is ours and complete (handed off with its first token) and, when adopted,
        every forward launched before its hand-over has finished."""
        return (r.stage is Stage.HANDED_OFF and r.req is not None and bool(r.req.output_ids)
                and (r.fence is None or self.handoffs.fence_passed(r.fence)))

    def _step(self, r: _Room[R], was: P, to: P) -> bool:
        """Move `r` from `was` to `to` under the lock; False when a cancel moved it first."""
        with self.lock:
            if r.room.state is not was:
                return False
            r.room.move(to)
            return True

    def _bootstrap(self, r: _Room[R], touched: list[R]) -> None:
        if r.req is not None and r.stage is Stage.PENDING:
            r.to_stage(Stage.SCHEDULED)  # prefill now: the decode's pages are needed only to write
            self.scheduler.add_request(r.req)
        if r.req is not None and r.target is not None:
            problem = self._target_problem(r.req, r.target)
            if problem:
                self._fail(r, problem, touched, "refused")
                return
            self._step(r, P.BOOTSTRAPPING, P.WAITING_FOR_INPUT)
        elif r.room.waited() > self.config.bootstrap_timeout_s:
            t = self.config.bootstrap_timeout_s
            why = (f"no decode server asked for room {r.number} within {t:.0f} s"
                   if r.req is not None else f"no request for room {r.number} within {t:.0f} s")
            self._fail(r, why, touched, "bootstrap_timeout")

    def _target_problem(self, req: R, target: RoomRequest) -> str | None:
        n = len(req.origin_input_ids)
        if target.prompt_len != n:
            return f"room {target.room}: the decode server has a {target.prompt_len}-token prompt, this prefill {n}"
        if len(target.dst_pages) != self.kv.allocator.pages_for(n):
            return f"room {target.room}: {len(target.dst_pages)} destination pages for {n} tokens"
        return None

    def _start_transfer(self, r: _Room[R]) -> None:
        req, target, peer = r.req, r.target, r.peer
        assert req is not None and target is not None and peer is not None
        if not self._step(r, P.WAITING_FOR_INPUT, P.QUEUED):
            return  # cancelled: the next poll fails it
        src = req.kv.pages[: len(target.dst_pages)]
        tags = sums = None
        if self.canary is not None:
            tags, sums, r.undo = self.canary.outgoing(req.rid, src, len(req.origin_input_ids))
        logprob, top, info = req.log.at(0)
        aux = AuxRecord(
            room=target.room, rid=req.rid, prompt_len=len(req.origin_input_ids),
            token=req.output_ids[0], logprob=logprob,
            top_logprobs=[list(x) for x in top] if top is not None else None,
            customized_info=info or None,
            cached_tokens=req.cached_tokens, slot_tags=tags, slot_sums=sums,
        )
        r.sending = self.sender.send(peer, src, target.dst_pages, aux, lambda: self._claim(r))
        r.sending.add_done_callback(lambda _: self.wake())

    def _finish_transfer(self, r: _Room[R], sending: Future[Sent], touched: list[R]) -> None:
        if r.undo is not None:  # the fault went out with the pages; the pages stay sound here
            r.undo()
        error = sending.exception()
        if error is not None:
            if isinstance(error, WriteInDoubt):
                with self.lock:
                    self.in_doubt.add(r.number)
            kind = "cancelled" if r.room.state is P.CANCELLED_QUEUED else "transfer_error"
            self._fail(r, f"KV transfer to the decode server failed: {error}", touched, kind)
            return
        sent = sending.result()
        self.stats.transfers += 1
        self.stats.transfer_bytes += sent.nbytes
        self.stats.transfer_seconds.append(sent.seconds)
        assert r.req is not None
        self.kv.release(r.req)
        if not r.req.finished:
            r.req.finish("length", "prefill done: KV sent to the decode server")
            touched.append(r.req)
        self._end(r)

    def _fail(self, r: _Room[R], reason: str, touched: list[R], kind: str) -> None:
        """End the room: free what it holds, finish its request, tell its decode server."""
        self.stats.failed(kind)
        if r.req is not None:
            self._end_request(r, r.req, reason, touched)
        if (r.peer is not None and r.target is not None and kind != "cancelled"
                and r.number not in self.in_doubt):  # its write is over, or never began
            self.sender.fail(r.peer, r.number, reason)
        if kind == "cancelled" and r.req is None:
            with self.lock:
                self.cancelled[r.number] = time.monotonic()
        log.info("room %d failed: %s", r.number, reason)
        self._end(r, reason)

    def _end_request(self, r: _Room[R], req: R, reason: str, touched: list[R]) -> None:
        """A failed room's request: still the scheduler's, it frees its KV and emits it; else
        we finish it here, and free its KV once the scheduler handed it off."""
        if not req.finished and not (r.stage is Stage.SCHEDULED
                                     and self.scheduler.abort(req.rid, reason)):
            req.finish("abort", reason)
            touched.append(req)
        if r.stage is Stage.HANDED_OFF:  # (every room whose write went to the sender is)
            self.kv.release(req)

    def _end(self, r: _Room[R], failure: str | None = None) -> None:
        """`r` ends (SUCCESS, or FAILED for `failure`) and leaves the table in one step under
        the lock: the bootstrap and sender threads never see an ended room."""
        with self.lock:
            if failure is None:
                r.room.move(P.SUCCESS)
            else:
                r.room.fail(failure)
            self.rooms.drop(r.number, r.req.rid if r.req is not None else None)

    def abort(self, rid: str, message: str) -> bool:
        with self.lock:
            r = self.rooms.find(rid)
        if r is None or r.req is None or r.req.finished:
            return False
        if r.room.state in PREFILL_SENDING:  # let the transfer end; its completion frees the pages
            r.req.finish("abort", message)
            self._aborted.append(r.req)
        else:
            self._fail(r, message, self._aborted, "aborted")
        self.wake()
        return True

    def requests(self) -> list[R]:
        with self.lock:
            return [r.req for r in self.rooms.values() if r.req is not None and not r.req.finished]

    def queued(self) -> int:
        with self.lock:
            return sum(1 for r in self.rooms.values()
                       if r.req is not None and r.stage is Stage.PENDING)

    def has_work(self) -> bool:
        return bool(self.rooms or self._aborted)

    def drain(self) -> None:
        pass  # what it holds is sent or fails within the bootstrap timeout; the scheduler drains

    def start(self, host: str) -> None:
        """Open the bootstrap server (on `host`, the configured port): from now on decode
        servers find this prefill and offer it rooms."""
        self.bootstrap = BootstrapServer(host, self.config.bootstrap_port, self, CallGate(self.key),
                                         self.tally)
        self.ready = True

    def close(self) -> None:
        """Writes end first and the bootstrap port closes last: a decode that finds it refusing
        connections may take it that this prefill writes nothing more. (The plane is closed by
        whoever opened it, after this.)"""
        self.sender.close()
        if self.bootstrap is not None:
            self.bootstrap.close()
