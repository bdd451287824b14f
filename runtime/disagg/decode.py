"""Decode role: the prealloc queue and the transfer queue in front of the scheduler.

A room's states and their table are in runtime/disagg/states.py (`DecodeState`, `DECODE`):
  PREALLOC           wait (never fail) until the pool has room for the prompt with the running
                     requests' reserve kept, then take the pages
  RESERVED           wait for the scheduler's KV fence (an overlapped forward may still write a
                     page just freed)
  REGISTERING        the page indices went to the prefill (POST /rooms, on a worker thread)
  WAITING_FOR_INPUT  the prefill took them: it may write into those pages now
  TRANSFERRING       (passed through) the backend says every page is in place and hands over the
                     aux record that came behind them: first token, logprob, customized_info
  SUCCESS            the aux record checks out: the request goes through `process_prebuilt` into
                     the running decode batch
  FAILED_*           the request ends with a clear error at once; its pages are freed only
                     once no write for the room can land in them (the fence, docs/kv-plane.md):
                     tcp: at once, the receiver refuses the room's frames from now on (`revoke`;
                     a write already landing ends first: a prefill declared gone has its links
                     broken off). nixl (one-sided WRITEs, which we cannot refuse): once the
                     prefill never knew the pages (FAILED_UNSEEN), or said its last word on the
                     room (FAILED_SETTLED: its KV or a RoomFailed came), or, from FAILED (it may
                     still write them), it answered the cancel "no write will happen", or its KV
                     arrived, or its bootstrap port refuses connections (the process is gone).
                     Until then the pages are quarantined (`stats.quarantined_pages`), never
                     freed on a timer.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic

from runtime.auth.ticket import peer_of
from runtime.config import DisaggConfig
from runtime.disagg.heartbeat import Heartbeats
from runtime.disagg.interfaces import HandoffPort, R, SchedulerPort
from runtime.disagg.lanes import Lanes
from runtime.disagg.move import Mover
from runtime.disagg.peers import Address, Ambiguous, PrefillClient
from runtime.disagg.plane import KVPlane
from runtime.disagg.receiver import KVReceiver
from runtime.disagg.rooms import Room, RoomError, RoomInUse, RoomTable, count_states
from runtime.disagg.states import (
    DECODE,
    DECODE_EXPOSED,
    DECODE_FAILS_TO,
    DECODE_RESERVING,
    RoomState,
)
from runtime.disagg.states import DecodeState as D
from runtime.disagg.wire import AuxRecord, RoomRequest
from runtime.kvcache.manager import KVCacheManager
from runtime.messages import DisaggStats

log = logging.getLogger(__name__)

SWEEP_S = 10.0  # how often lanes no room needs are shut down


@dataclass(eq=False)
class _Room(Generic[R]):
    room: Room[D]
    req: R
    addr: Address
    ticket: str | None  # the router's, for the room (its prefill checks it)
    fence: int | None = None  # from RESERVED on: the KV fence its pages were taken at
    registering: Future[str] | None = None  # from REGISTERING on: POST /rooms; gives the
    # prefill's instance id
    cancel: Future[bool] | None = None  # failed: DELETE /rooms; True: "no write will happen"
    cancel_at: float = 0.0  # when to ask again (a frozen prefill answers nothing)

    @property
    def number(self) -> int:
        return self.room.number


@dataclass
class DecodeRole(Generic[R]):
    scheduler: SchedulerPort[R]
    handoffs: HandoffPort[R]  # the scheduler's: room for a request, prebuilt ones, the KV fence
    kv: KVCacheManager
    plane: KVPlane  # its fence wakes the loop when KV arrives (`wake`, given to open_plane)
    client: PrefillClient
    receiver: KVReceiver
    config: DisaggConfig
    wake: Callable[[], None]
    vocab_size: int
    stats: DisaggStats = field(default_factory=DisaggStats)
    mover: Mover[R] | None = None  # drains by moving its streams' KV to another decode

    def __post_init__(self) -> None:
        self.transfer, self.fence, self.tally = self.plane.transfer, self.plane.fence, self.plane.tally
        self.canary = self.plane.canary  # checks the prompt KV on arrival
        self.rooms: RoomTable[_Room[R]] = RoomTable()  # the scheduler loop's thread only
        self.prealloc: deque[int] = deque()
        self.lanes = Lanes("decode-peers")  # per prefill: a frozen one holds up only its own
        self.sweep_at = 0.0
        self.heartbeats = Heartbeats(
            self.client.alive, lambda addr, fn: self.lanes.submit((addr, "health"), fn, addr),
            self.config, self.wake)
        self._aborted: list[R] = []

    def start(self) -> None:
        """Serve KV links on the receiver's port (peers learn it from the client's
        registration)."""
        self.receiver.start()

    def add(self, req: R) -> None:
        boot = req.bootstrap
        if self.config.allow_local_prefill and boot is None:
            self.scheduler.add_request(req)  # prefilled here (the router's fallback)
            return
        if boot is None or not boot.host or boot.port is None:
            raise RoomError("a decode server needs bootstrap_host, bootstrap_port and "
                            "bootstrap_room (send requests through `baton router`)")
        self.scheduler.validate(req)
        if boot.room in self.rooms:
            raise RoomInUse(f"bootstrap room {boot.room} is already in use")
        self.rooms.setdefault(boot.room, _Room(Room(boot.room, DECODE), req, (boot.host, boot.port),
                                               boot.ticket))
        self.rooms.name(req.rid, boot.room)
        self.prealloc.append(boot.room)

    def poll(self) -> list[R]:
        """Advance every room; returns the requests to emit (first tokens, failures)."""
        touched, self._aborted = self._aborted, []
        self._take_failures(touched)
        self._preallocate()
        for addr in self.heartbeats.check(self._watched()):
            self._prefill_gone(addr, touched)
        for r in list(self.rooms.values()):
            self._advance(r, touched)
        moving = self.mover.rooms() if self.mover is not None else []
        self.stats.rooms = count_states([*(r.room for r in self.rooms.values()), *moving])
        self.stats.quarantined_pages = sum(len(r.req.kv.pages) for r in self.rooms.values()
                                           if r.room.phase is RoomState.FAILED)
        self.stats.count_kv_plane(self.tally.take())
        if self.mover is not None:
            touched.extend(self.mover.poll())
        if time.monotonic() >= self.sweep_at:  # lanes of prefills no room needs any more
            self.sweep_at = time.monotonic() + SWEEP_S
            watched = self._watched() | set(self.heartbeats.pending)
            self.lanes.sweep({r.addr for r in self.rooms.values()}
                             | {(a, "health") for a in watched})
        return touched

    def _take_failures(self, touched: list[R]) -> None:
        while True:
            try:
                prefill, frame = self.receiver.failed.get_nowait()
            except queue.Empty:
                return
            r = self.rooms.get(frame.room)
            if r is None or self.fence.peer_of(frame.room) != prefill:
                continue  # a room we already ended, or not one this prefill was given
            if r.room.state in (D.FAILED, D.FAILED_UNSEEN):
                r.room.move(D.FAILED_SETTLED)  # failed here first: the prefill writes no more
            else:
                self._fail(r, f"the prefill server failed: {frame.reason}", touched,
                           "prefill_failed", D.FAILED_SETTLED)

    def _preallocate(self) -> None:
        while self.prealloc:
            r = self.rooms.get(self.prealloc[0])
            if r is None or r.room.ended:
                self.prealloc.popleft()
                continue
            incoming = [x.req for x in self.rooms.values() if x.room.state in DECODE_RESERVING]
            if not self.handoffs.can_reserve(r.req, incoming):
                return  # the pool is full: wait, in arrival order, never fail for it
            self.kv.grow(r.req, len(r.req.origin_input_ids))
            r.fence = self.handoffs.kv_fence()
            r.room.move(D.RESERVED)
            self.prealloc.popleft()

    def _advance(self, r: _Room[R], touched: list[R]) -> None:
        if r.room.phase is RoomState.FAILED:
            self._settle(r)
            return
        if r.room.phase is RoomState.BOOTSTRAPPING:
            self._register(r, touched)
            if r.room.state is not D.WAITING_FOR_INPUT:
                return  # (the KV may have arrived before the prefill's answer to POST /rooms)
        if (aux := self.fence.arrived(r.number)) is not None:
            r.room.move(D.TRANSFERRING)  # the prefill writes no more
            self._prebuilt(r, aux, touched)
        elif r.room.waited() > self.config.waiting_timeout_s:  # waiting for input, or to land
            t = self.config.waiting_timeout_s
            self._fail(r, f"the KV for room {r.number} did not arrive within {t:.0f} s",
                       touched, "waiting_timeout")

    def _register(self, r: _Room[R], touched: list[R]) -> None:
        state = r.room.state
        if state is D.RESERVED and r.fence is not None and self.handoffs.fence_passed(r.fence):
            self._expose(r)
        elif state is D.REGISTERING:
            assert r.registering is not None
            if r.registering.done():
                self._registered(r, r.registering, touched)
        elif r.room.waited() > self.config.bootstrap_timeout_s:  # no pages yet, or no fence
            self._fail(r, f"no KV pages for room {r.number} within "
                       f"{self.config.bootstrap_timeout_s:.0f} s", touched, "bootstrap_timeout")

    def _expose(self, r: _Room[R]) -> None:
        """Offer the room's pages to the prefill (POST /rooms): it may know them from now on."""
        request = RoomRequest(r.number, self.client.me.decode_id, r.req.rid,
                              len(r.req.origin_input_ids), list(r.req.kv.pages),
                              self.config.waiting_timeout_s, r.ticket)
        # the prefill the router's ticket names, or the one that answers at the address
        self.fence.expect(r.number, request.dst_pages, peer_of(r.ticket))
        r.room.move(D.REGISTERING)
        r.registering = self.lanes.submit(r.addr, self.client.register_room, r.addr, request)
        r.registering.add_done_callback(lambda _: self.wake())

    def _registered(self, r: _Room[R], registering: Future[str], touched: list[R]) -> None:
        error = registering.exception()
        if error is None:
            r.room.move(D.WAITING_FOR_INPUT)
            return
        kind = "room_in_use" if isinstance(error, RoomInUse) else "refused"
        # refused: it never took our pages; no clear answer: it may have them
        self._fail(r, str(error), touched, kind,
                   D.FAILED if isinstance(error, Ambiguous) else D.FAILED_UNSEEN)

    def _prebuilt(self, r: _Room[R], aux: AuxRecord, touched: list[R]) -> None:
        problem = self._aux_problem(r.req, aux)
        if problem:
            self._fail(r, problem, touched, "bad_aux")
            return
        if self.canary is not None and (problem := self.canary.arrival_problem(
                r.req.rid, r.req.origin_input_ids, r.req.kv.pages, aux.slot_tags, aux.slot_sums)):
            self._fail(r, problem, touched, "kv_canary")  # its KV is here: nothing more can land
            return
        top = [(int(t), float(lp)) for t, lp in aux.top_logprobs] if aux.top_logprobs else None
        r.req.append_token(aux.token, aux.logprob, top, aux.customized_info)
        r.req.cached_tokens = aux.cached_tokens
        r.room.move(D.SUCCESS)
        self.stats.transfers += 1
        self.stats.transfer_bytes += len(r.req.kv.pages) * self.transfer.layout.page_bytes
        self.fence.discard(r.number)
        self._drop(r)
        touched.extend(self.handoffs.process_prebuilt([r.req]))

    def _aux_problem(self, req: R, aux: AuxRecord) -> str | None:
        if aux.room != req.bootstrap_room or aux.prompt_len != len(req.origin_input_ids):
            return (f"aux record mismatch: room {aux.room} / {aux.prompt_len} tokens for room "
                    f"{req.bootstrap_room} / {len(req.origin_input_ids)} tokens")
        if not 0 <= aux.token < self.vocab_size:
            return f"aux record for room {aux.room}: token {aux.token} outside the vocabulary"
        return None

    def _fail(self, r: _Room[R], reason: str, touched: list[R], kind: str,
              to: D | None = None) -> None:
        """End the room's request at once; free its pages once no write can land in them. It
        fails into `to`, else where its state fails to (DECODE_FAILS_TO: what the prefill may
        know of its pages)."""
        if r.room.ended:
            return  # a late failure: Failed wins, Success is not undone
        r.room.fail(reason, to if to is not None else DECODE_FAILS_TO[r.room.state])
        self.stats.failed(kind)
        if not r.req.finished:
            r.req.finish("abort", reason)
            touched.append(r.req)
        log.info("room %d failed: %s", r.number, reason)
        self._settle(r)

    def _settle(self, r: _Room[R]) -> None:
        """A failed room: free its pages once no write for it can land in them."""
        if not self._writes_over(r):
            return
        if r.room.state is not D.FAILED_SETTLED and self.fence.arrived(r.number) is not None:
            self.tally.add("late_write_contained")  # it came after we gave up: pages kept back
        self.kv.release(r.req)
        self.fence.discard(r.number)
        self._drop(r)

    def _writes_over(self, r: _Room[R]) -> bool:
        closed = self.fence.revoke(r.number)  # no write is admitted at our door from now
        told = self._cancel(r)  # so the prefill neither computes nor sends it for nothing
        if not self.transfer.one_sided:
            return closed  # False while a write is landing: it ends, then we are woken
        if r.registering is not None and not r.registering.done():
            return False  # the prefill may be taking our pages right now
        # FAILED_UNSEEN / FAILED_SETTLED: it never had them, or it said its last word
        return (r.room.state is not D.FAILED or told
                or self.fence.arrived(r.number) is not None)

    def _cancel(self, r: _Room[R]) -> bool:
        """Ask the prefill to cancel the room (again every heartbeat interval until it answers);
        True once it promised that no write will happen, or is gone."""
        if r.room.state is not D.FAILED:
            return False  # it never had our pages, or it said its last word
        if r.cancel is not None and r.cancel.done() and r.cancel.exception() is None \
                and r.cancel.result():
            return True
        if r.cancel is None or (r.cancel.done() and time.monotonic() >= r.cancel_at):
            r.cancel = self.lanes.submit(r.addr, self.client.cancel_room, r.addr, r.number)
            r.cancel.add_done_callback(lambda _: self.wake())
            r.cancel_at = time.monotonic() + self.config.heartbeat_interval_s
        return False

    def _prefill_gone(self, addr: Address, touched: list[R]) -> None:
        rooms = [r for r in self.rooms.values() if r.addr == addr]
        prefills = {self.fence.peer_of(r.number) for r in rooms}
        for r in rooms:
            self._fail(r, f"the prefill server at {addr[0]}:{addr[1]} stopped answering",
                       touched, "prefill_gone")
        for prefill in prefills - {None}:  # tcp: a write of its landing now breaks off
            self.receiver.close_links(prefill)  # type: ignore[arg-type]
        self.client.forget(addr)  # whoever answers there next is introduced anew

    def _watched(self) -> set[Address]:
        return {r.addr for r in self.rooms.values() if r.room.state in DECODE_EXPOSED}

    def _drop(self, r: _Room[R]) -> None:
        self.rooms.drop(r.number, r.req.rid)

    def abort(self, rid: str, message: str) -> bool:
        r = self.rooms.find(rid)
        if r is None:
            return self.scheduler.abort(rid, message)  # prebuilt already: the scheduler's
        if r.req.finished:
            return False
        self._fail(r, message, self._aborted, "aborted")
        self.wake()
        return True

    def requests(self) -> list[R]:
        return [r.req for r in self.rooms.values() if not r.req.finished]

    def queued(self) -> int:
        # all wait for their KV (or pages) before the scheduler; counted, not listed: the loop
        # asks every breath
        return sum(1 for r in self.rooms.rooms.values() if not r.req.finished)

    def has_work(self) -> bool:
        return bool(self.rooms or self._aborted) or (self.mover is not None
                                                     and self.mover.has_work())

    def drain(self) -> None:
        """The server drains: its followed streams move to another decode, KV and all."""
        if self.mover is not None:
            self.mover.drain()
            self.wake()

    def close(self) -> None:
        if self.mover is not None:
            self.mover.close()
        self.receiver.close()
        self.lanes.shutdown()
        self.client.close()  # (the plane is closed by whoever opened it, after this)
