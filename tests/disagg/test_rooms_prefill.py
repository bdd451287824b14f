"""The prefill role's room state machine, one poll at a time, against a fake scheduler and a
fake sender (tests/disagg/room_fakes.py): every transition and every failure path, and what each
leaves behind (KV freed, the decode told or not, the request finished how)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from runtime.disagg.plane import KVPlane
from runtime.disagg.prefill import PrefillRole
from runtime.disagg.rooms import RoomInUse, RoomState
from runtime.disagg.transfer.base import TransferError, WriteInDoubt
from runtime.disagg.transfer.tcp import TcpTransfer
from runtime.disagg.wire import PeerRegistration, RoomRequest
from runtime.scheduler.req import Req
from tests.disagg.room_fakes import (
    CONFIG,
    FakeScheduler,
    FakeSender,
    kv_manager,
    polls_until,
    request,
    state,
)

DECODE = "baton-decode-D"


class World:
    def __init__(self) -> None:
        self.kv, pool = kv_manager()
        self.scheduler = FakeScheduler(self.kv)
        self.sender = FakeSender()
        self.woken = 0
        self.role: PrefillRole[Req] = PrefillRole(
            self.scheduler, self.scheduler, self.kv, KVPlane(TcpTransfer(pool, "baton-prefill-A")),
            self.sender, CONFIG, self.wake)  # type: ignore[arg-type]
        self.role.register_peer(PeerRegistration(DECODE, "10.0.0.2", 8999,
                                                 {"num_layers": 2, "page_size": 4,
                                                  "num_kv_heads": 2, "head_dim": 8,
                                                  "dtype": "float32"}, "tcp"))

    def wake(self) -> None:
        self.woken += 1

    def offer(self, room: int, prompt_len: int = 10, pages: int = 3, wait_s: float = 30) -> None:
        self.role.offer_room(RoomRequest(room, DECODE, f"r{room}", prompt_len,
                                         list(range(pages)), wait_s))


@pytest.fixture
def w() -> Iterator[World]:
    world = World()
    yield world
    world.role.close()


def test_request_then_pages_then_a_cancel_before_the_write_claims_it(w: World) -> None:
    req = request("r1", 1)
    w.role.add(req)
    assert state(w.role, 1) is RoomState.BOOTSTRAPPING and req.hand_off
    assert w.role.poll() == [] and w.scheduler.added == [req]  # prefilled before the pages come
    w.offer(1)
    w.role.poll()
    assert state(w.role, 1) is RoomState.WAITING_FOR_INPUT and not w.sender.sends
    w.scheduler.finish_prompt(req)
    w.role.poll()
    assert state(w.role, 1) is RoomState.TRANSFERRING
    (room, dst, _, _), = w.sender.sends
    assert (room, dst) == (1, [0, 1, 2])
    assert w.role.cancel_room(1) is True  # not claimed yet: the write will not happen
    w.sender.complete(1)
    touched = w.role.poll()
    assert touched == [req] and req.finished_reason.kind == "abort"  # type: ignore[union-attr]
    assert "cancelled" in (req.finished_reason.message or "")  # type: ignore[union-attr]
    assert state(w.role, 1) is None and w.kv.is_all_free() and not w.sender.failed


def test_pages_then_request_then_success_frees_everything(w: World) -> None:
    w.offer(2)
    w.role.poll()
    assert state(w.role, 2) is RoomState.BOOTSTRAPPING  # pages alone: waits for the request
    req = request("r2", 2)
    w.role.add(req)
    w.role.poll()
    assert state(w.role, 2) is RoomState.WAITING_FOR_INPUT
    w.scheduler.finish_prompt(req)
    w.role.poll()
    w.sender.complete(2)
    assert w.role.cancel_room(2) is False  # written (claimed): the decode waits for its KV
    assert w.role.poll() == [req] and req.finished_reason.kind == "length"  # type: ignore[union-attr]
    assert state(w.role, 2) is None and w.kv.is_all_free()
    assert w.role.stats.transfers == 1 and w.role.cancel_room(2) is True  # gone: nothing to write


def test_bootstrap_timeouts_on_either_side(w: World) -> None:
    req = request("r3", 3)
    w.role.add(req)
    w.role.poll()
    w.offer(4)  # pages with no request
    touched = polls_until(w.role, lambda: state(w.role, 3) is None and state(w.role, 4) is None)
    assert w.scheduler.aborted == ["r3"] and req.finished and touched == []  # the scheduler emits
    assert [(d, room) for d, room, _ in w.sender.failed] == [(DECODE, 4)]  # the decode is told
    assert "no request for room 4" in w.sender.failed[0][2]
    assert w.role.stats.failures == {"bootstrap_timeout": 2} and w.kv.is_all_free()


def test_a_room_that_does_not_match_the_request_is_refused(w: World) -> None:
    req = request("r5", 5, prompt_len=10)
    w.role.add(req)
    w.offer(5, prompt_len=12, pages=3)
    w.role.poll()
    assert state(w.role, 5) is None and w.role.stats.failures == {"refused": 1}
    assert "12-token prompt" in w.sender.failed[0][2] and w.scheduler.aborted == ["r5"]


def test_cancel_before_the_write_never_writes_and_tells_nobody(w: World) -> None:
    req = request("r6", 6)
    w.role.add(req)
    w.offer(6)
    w.role.poll()
    w.scheduler.finish_prompt(req)
    assert w.role.cancel_room(6) is True
    touched = w.role.poll()
    assert touched == [req] and not w.sender.sends and not w.sender.failed
    assert w.role.stats.failures == {"cancelled": 1} and w.kv.is_all_free()


def test_a_cancel_before_the_request_fails_it_when_it_comes(w: World) -> None:
    w.offer(7)
    assert w.role.cancel_room(7) is True
    w.role.poll()
    req = request("r7", 7)
    w.role.add(req)
    assert w.role.poll() == [req] and req.finished and not w.scheduler.added


def test_an_expired_room_is_not_written_and_its_decode_is_told(w: World) -> None:
    req = request("r8", 8)
    w.role.add(req)
    w.offer(8, wait_s=0.05)
    w.role.poll()
    w.scheduler.finish_prompt(req)
    w.role.poll()
    time.sleep(0.1)  # the decode's wait is over before the sender gets to it
    w.sender.complete(8)
    w.role.poll()
    assert w.role.stats.failures == {"transfer_error": 1}
    assert "stopped waiting" in w.sender.failed[0][2] and w.kv.is_all_free()


@pytest.mark.parametrize("error", [TransferError("link broke"), WriteInDoubt("not done")])
def test_a_failed_write_tells_the_decode_unless_it_may_still_land(w: World,
                                                                 error: Exception) -> None:
    req = request("r9", 9)
    w.role.add(req)
    w.offer(9)
    w.role.poll()
    w.scheduler.finish_prompt(req)
    w.role.poll()
    w.sender.complete(9, error)
    w.role.poll()
    assert req.finished and w.kv.is_all_free() and state(w.role, 9) is None
    if isinstance(error, WriteInDoubt):
        assert not w.sender.failed and w.role.cancel_room(9) is False  # never a false promise
    else:
        assert [room for _, room, _ in w.sender.failed] == [9] and w.role.cancel_room(9)


def test_abort_before_and_during_the_write(w: World) -> None:
    early, late = request("ra", 10), request("rb", 11)
    for req in (early, late):
        w.role.add(req)
    w.offer(10)
    w.offer(11)
    w.role.poll()
    assert w.role.abort("ra", "client left") is True
    assert w.scheduler.aborted == ["ra"]  # still the scheduler's: it frees and emits
    w.scheduler.finish_prompt(late)
    w.role.poll()
    assert w.role.abort("rb", "client left") is True
    assert w.role.poll() == [late] and late.finished_reason.kind == "abort"  # type: ignore[union-attr]
    assert not w.kv.is_all_free()  # its write goes on; the pages are freed when it ends
    w.sender.complete(11)
    w.role.poll()
    assert w.kv.is_all_free() and state(w.role, 11) is None
    assert w.role.abort("rb", "again") is False


def test_a_room_or_request_twice_is_refused(w: World) -> None:
    w.role.add(request("rc", 12))
    with pytest.raises(RoomInUse):
        w.role.add(request("rd", 12))
    w.offer(12)
    with pytest.raises(RoomInUse):
        w.offer(12)


def test_a_handed_off_request_of_no_room_only_frees_its_kv(w: World) -> None:
    stray = request("rs", 99)  # its room ended while the scheduler still had it
    w.scheduler.finish_prompt(stray)
    assert not w.kv.is_all_free()
    assert w.role.poll() == [] and w.kv.is_all_free()


def test_a_request_the_scheduler_ends_before_its_hand_off_fails_its_room(w: World) -> None:
    """The KV canary (raise) ends a prefill whose KV is not its own: the scheduler finishes it
    and frees its KV; the role then fails the room and tells the decode server."""
    req = request("r9", 9)
    w.role.add(req)
    w.offer(9)
    w.role.poll()
    assert state(w.role, 9) is RoomState.WAITING_FOR_INPUT
    req.finish("abort", "KV canary: ...")  # what Scheduler.process does, KV discarded with it
    w.role.poll()
    assert state(w.role, 9) is None and not w.sender.sends
    assert [(d, room) for d, room, _ in w.sender.failed] == [(DECODE, 9)]
    assert w.kv.is_all_free()
