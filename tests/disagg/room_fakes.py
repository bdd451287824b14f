"""What the prefill and decode roles talk to, played in-process so that every transition of their
room state machines can be driven and checked one poll at a time (tests/disagg/test_rooms_*.py):
a SchedulerPort (and HandoffPort) that records what it is given, a sender and a prefill client whose answers the
test decides, and a receiver that is only its queue. The roles themselves, their KV manager and
transfer backend (tcp; `OneSided` answers as nixl does) are the real ones."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from runtime.config import DisaggConfig
from runtime.disagg.rooms import RoomState
from runtime.disagg.sender import Sent
from runtime.disagg.transfer.base import TransferError
from runtime.disagg.transfer.tcp import TcpTransfer
from runtime.disagg.wire import AuxRecord, PeerRegistration, RoomFailed, RoomRequest
from runtime.handover import Bootstrap
from runtime.kvcache.allocator import PageAllocator
from runtime.kvcache.manager import KVCacheManager
from runtime.kvcache.pool import KVPool
from runtime.kvcache.req_to_token import ReqToTokenPool
from runtime.sampling_params import SamplingParams
from runtime.scheduler.req import Req

PAGE = 4
CONFIG = DisaggConfig(bootstrap_timeout_s=0.3, waiting_timeout_s=0.3, heartbeat_interval_s=0.05,
                      heartbeat_misses=2)


def kv_manager(num_pages: int = 32) -> tuple[KVCacheManager, KVPool]:
    pool = KVPool(2, num_pages, PAGE, 2, 8, torch.float32)
    return KVCacheManager(PageAllocator(num_pages, PAGE), ReqToTokenPool(8, 256)), pool


def request(rid: str, room: int, prompt_len: int = 10, max_new: int = 8,
            host: str = "10.0.0.1", port: int = 8998) -> Req:
    return Req(rid, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=max_new),
               bootstrap=Bootstrap(room, host, port))


class FakeScheduler:
    """A SchedulerPort and HandoffPort: records requests, aborts and prebuilt ones; the test decides capacity,
    the KV fence, and when a hand-off request's prompt is done (`finish_prompt`)."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.added: list[Req] = []
        self.aborted: list[str] = []
        self.prebuilt: list[Req] = []
        self.handed: list[Req] = []
        self.room_for = True
        self.fence = 0
        self.passed = 0

    def add_request(self, req: Req) -> None:
        self.added.append(req)

    def validate(self, req: Req) -> None:
        pass

    def abort(self, rid: str, message: str = "aborted") -> bool:
        req = next((r for r in self.added if r.rid == rid and not r.finished), None)
        if req is None:
            return False
        if req in self.handed:  # not taken yet: still the scheduler's
            self.handed.remove(req)
        self.aborted.append(rid)
        req.finish("abort", message)
        self.kv.release(req)
        return True

    def process_prebuilt(self, reqs: list[Req]) -> list[Req]:
        self.prebuilt += reqs
        return reqs

    def can_reserve(self, req: Req, incoming: Sequence[Req] = ()) -> bool:
        return self.room_for

    def kv_fence(self) -> int:
        self.fence += 1
        return self.fence

    def fence_passed(self, fence: int) -> bool:
        return self.passed >= fence

    def take_handed_off(self) -> list[Req]:
        out, self.handed = self.handed, []
        return out

    def finish_prompt(self, req: Req, token: int = 7) -> None:
        """The prompt's forward ran: its KV, its first token; handed over to the role."""
        self.kv.grow(req, len(req.origin_input_ids))
        req.append_token(token)
        self.handed.append(req)


class FakeSender:
    """KVSender as the prefill role uses it: each send is a future the test completes (after
    the role's claim, as the real sender does); RoomFailed frames are recorded."""

    def __init__(self) -> None:
        self.sends: list[tuple[int, list[int], Future[Sent], Callable[[], None]]] = []
        self.failed: list[tuple[str, int, str]] = []

    def send(self, peer: PeerRegistration, src: list[int], dst: list[int], aux: AuxRecord,
             claim: Callable[[], None]) -> Future[Sent]:
        future: Future[Sent] = Future()
        self.sends.append((aux.room, dst, future, claim))
        return future

    def complete(self, room: int, error: Exception | None = None) -> None:
        """The sender thread's work for `room`: claim, then write (or fail)."""
        _, dst, future, claim = next(s for s in self.sends if s[0] == room)
        try:
            claim()
        except TransferError as e:
            future.set_exception(e)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(Sent(room, len(dst) * 64, 0.001))

    def fail(self, peer: PeerRegistration, room: int, reason: str) -> None:
        self.failed.append((peer.decode_id, room, reason))

    def close(self) -> None:
        pass


class FakeClient:
    """PrefillClient as the decode role uses it; `register` and `cancel` decide the answers
    (a value, or an exception to raise), `gone` makes heartbeats fail."""

    def __init__(self, transfer: TcpTransfer, instance: str = "baton-prefill-A") -> None:
        self.me = PeerRegistration("baton-decode-D", "10.0.0.2", 8999,
                                   {"num_layers": 2, "page_size": PAGE, "num_kv_heads": 2,
                                    "head_dim": 8, "dtype": "float32"}, "tcp")
        self.transfer, self.instance = transfer, instance
        self.registered: dict[tuple[str, int], str] = {}
        self.rooms: list[RoomRequest] = []
        self.register: Exception | None = None
        self.hold: threading.Event | None = None  # POST /rooms answers once it is set
        self.posted = 0  # POST /rooms sent (answered or not)
        self.cancel: bool | Exception = True
        self.cancels: list[int] = []
        self.gone = False
        self.forgotten: list[tuple[str, int]] = []

    def register_room(self, addr: tuple[str, int], request: RoomRequest) -> str:
        self.posted += 1
        if self.hold is not None:
            self.hold.wait(10)
        if self.register is not None:
            raise self.register
        if not self.transfer.fence.bind_peer(request.room, self.instance):
            raise TransferError("room ended")
        self.rooms.append(request)
        return self.instance

    def cancel_room(self, addr: tuple[str, int], room: int) -> bool:
        self.cancels.append(room)
        if isinstance(self.cancel, Exception):
            raise self.cancel
        return self.cancel

    def alive(self, addr: tuple[str, int]) -> bool:
        return not self.gone

    def forget(self, addr: tuple[str, int]) -> None:
        self.forgotten.append(addr)

    def close(self) -> None:
        pass


class FakeReceiver:
    def __init__(self) -> None:
        self.failed: queue.SimpleQueue[tuple[str, RoomFailed]] = queue.SimpleQueue()
        self.cut: list[str] = []

    def start(self) -> None:
        pass

    def close_links(self, prefill: str) -> None:
        self.cut.append(prefill)

    def close(self) -> None:
        pass


class OneSided(TcpTransfer):
    """The decode side of a one-sided backend (nixl): writes it cannot refuse at its door."""

    one_sided = True


def polls_until(role: Any, check: Callable[[], bool], timeout: float = 5.0) -> list[Req]:
    """Poll the role until `check()`; every request its polls returned."""
    touched: list[Req] = []
    deadline = time.monotonic() + timeout
    while True:
        touched += role.poll()
        if check():
            return touched
        assert time.monotonic() < deadline, "the role never got there"
        time.sleep(0.005)


def state(role: Any, room: int) -> RoomState | None:
    """The phase of `room` in `role` (None: not in its table)."""
    r = role.rooms.get(room)
    return None if r is None else r.room.phase
