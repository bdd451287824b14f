"""The decode role's room state machine, one poll at a time, against a fake scheduler and a fake
prefill client (tests/disagg/room_fakes.py), with the real tcp transfer (`OneSided` where a
nixl-like backend's rules apply): every transition and failure path, and when the pages of a
failed room may be freed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from runtime.disagg.decode import DecodeRole
from runtime.disagg.peers import Ambiguous
from runtime.disagg.plane import KVPlane
from runtime.disagg.rooms import RoomInUse, RoomState
from runtime.disagg.transfer.base import TransferError
from runtime.disagg.transfer.tcp import TcpTransfer
from runtime.disagg.wire import AuxRecord, RoomFailed
from runtime.scheduler.req import Req
from tests.disagg.room_fakes import (
    CONFIG,
    FakeClient,
    FakeReceiver,
    FakeScheduler,
    OneSided,
    kv_manager,
    polls_until,
    request,
    state,
)

PREFILL = "baton-prefill-A"


class World:
    def __init__(self, one_sided: bool = False) -> None:
        self.kv, pool = kv_manager()
        self.scheduler = FakeScheduler(self.kv)
        self.transfer = (OneSided if one_sided else TcpTransfer)(pool, "baton-decode-D")
        self.fence = self.transfer.fence
        self.client = FakeClient(self.transfer, PREFILL)
        self.receiver = FakeReceiver()
        self.role: DecodeRole[Req] = DecodeRole(
            self.scheduler, self.scheduler, self.kv, KVPlane(self.transfer), self.client,  # type: ignore[arg-type]
            self.receiver, CONFIG, lambda: None, 1000)  # type: ignore[arg-type]

    def registered(self, req: Req) -> None:
        """Add `req` and poll until its room waits for the prefill's KV."""
        self.role.add(req)
        self.scheduler.passed = 10**9  # every KV fence passed
        polls_until(self.role, lambda: state(self.role, req.bootstrap_room) is  # type: ignore[arg-type]
                    RoomState.WAITING_FOR_INPUT)

    def arrive(self, req: Req, token: int = 9, room: int | None = None) -> None:
        aux = AuxRecord(room if room is not None else req.bootstrap_room, req.rid,  # type: ignore[arg-type]
                        len(req.origin_input_ids), token)
        self.fence.arrive(aux, PREFILL)


@pytest.fixture(params=[False, True], ids=["tcp", "one-sided"])
def w(request: pytest.FixtureRequest) -> Iterator[World]:
    world = World(one_sided=request.param)
    yield world
    world.role.close()


def test_pages_fence_registration_then_kv_then_prebuilt(w: World) -> None:
    req = request("r1", 1)
    w.scheduler.room_for = False
    w.role.add(req)
    w.role.poll()
    assert state(w.role, 1) is RoomState.BOOTSTRAPPING and w.kv.is_all_free()  # pool full: waits
    w.scheduler.room_for = True
    w.role.poll()
    assert len(req.kv.pages) == 3 and not w.client.rooms  # pages taken; the fence not passed yet
    w.scheduler.passed = 10**9
    polls_until(w.role, lambda: state(w.role, 1) is RoomState.WAITING_FOR_INPUT)
    (sent,) = w.client.rooms
    assert (sent.room, sent.dst_pages, sent.prompt_len) == (1, req.kv.pages, 10)
    assert w.fence.peer_of(1) == PREFILL
    w.arrive(req)
    touched = w.role.poll()
    assert touched == [req] and w.scheduler.prebuilt == [req] and req.output_ids == [9]
    assert state(w.role, 1) is None and w.role.stats.transfers == 1


@pytest.mark.parametrize("answer,kind,exposed", [
    (TransferError("prefill refused"), "refused", False),
    (RoomInUse("taken"), "room_in_use", False),
    (Ambiguous("no answer"), "refused", True),
])
def test_a_failed_registration_fails_the_room(w: World, answer: Exception, kind: str,
                                              exposed: bool) -> None:
    w.client.register = answer
    w.client.cancel = False  # a one-sided room the prefill may know stays quarantined
    req = request("r2", 2)
    w.role.add(req)
    w.scheduler.passed = 10**9
    touched = polls_until(w.role, lambda: req.finished)
    assert touched == [req] and str(answer) in (req.finished_reason.message or "")  # type: ignore[union-attr]
    assert w.role.stats.failures == {kind: 1}
    held = exposed and w.transfer.one_sided  # Ambiguous: the prefill may have the pages
    time.sleep(0.1)
    w.role.poll()
    assert w.kv.is_all_free() is not held
    if held:
        assert w.role.stats.quarantined_pages == 3
        w.client.cancel = True  # it answers: no write will happen
        polls_until(w.role, w.kv.is_all_free)


def test_a_room_failed_while_its_registration_is_unanswered(w: World) -> None:
    """The POST /rooms went out and has no answer yet when the room fails (the client left):
    the prefill may know the pages already. One-sided, they stay quarantined until the prefill
    says no write will happen; tcp, they are freed at once (the receiver refuses the room)."""
    gate = threading.Event()
    w.client.hold, w.client.cancel = gate, False
    req = request("r5", 5)
    w.role.add(req)
    w.scheduler.passed = 10**9
    try:
        polls_until(w.role, lambda: w.client.posted == 1)  # sent, unanswered
        assert w.role.abort("r5", "client left") is True
        w.role.poll()
        assert req.finished and w.kv.is_all_free() is not w.transfer.one_sided
    finally:
        gate.set()  # the POST answers late: the room has ended
    time.sleep(0.05)
    w.role.poll()
    if w.transfer.one_sided:
        assert not w.kv.is_all_free() and w.role.stats.quarantined_pages == 3
        w.client.cancel = True  # it answers: no write will happen
        polls_until(w.role, w.kv.is_all_free)
    assert w.kv.is_all_free()


def test_a_room_whose_kv_never_comes_times_out(w: World) -> None:
    req = request("r3", 3)
    w.registered(req)
    touched = polls_until(w.role, lambda: req.finished)
    assert touched == [req] and "did not arrive within" in req.finished_reason.message  # type: ignore[union-attr,operator]
    polls_until(w.role, w.kv.is_all_free)  # tcp at once; one-sided once the cancel says so
    polls_until(w.role, lambda: w.client.cancels == [3])  # (tcp: so the prefill stops work)
    assert state(w.role, 3) is None


def test_room_failed_from_its_prefill_ends_it_and_from_another_is_ignored(w: World) -> None:
    mine, other = request("r4", 4), request("r5", 5)
    w.registered(mine)
    w.registered(other)
    w.receiver.failed.put(("baton-prefill-intruder", RoomFailed(5, "not yours")))
    w.receiver.failed.put((PREFILL, RoomFailed(4, "its prefill broke")))
    touched = w.role.poll()
    assert touched == [mine] and "its prefill broke" in mine.finished_reason.message  # type: ignore[union-attr,operator]
    assert state(w.role, 5) is RoomState.WAITING_FOR_INPUT  # untouched by the intruder
    assert w.client.cancels == []  # its prefill said its last word: free at once
    assert len(mine.kv.pages) == 0 and len(other.kv.pages) == 3


def test_an_aux_record_that_does_not_match_fails_the_room(w: World) -> None:
    req = request("r6", 6)
    w.registered(req)
    w.arrive(req, token=5000)  # outside the vocabulary of 1000
    touched = w.role.poll()
    assert touched == [req] and w.role.stats.failures == {"bad_aux": 1}
    polls_until(w.role, w.kv.is_all_free)  # its KV arrived: the prefill writes no more


def test_a_prefill_declared_gone(w: World) -> None:
    req = request("r7", 7)
    w.registered(req)
    w.client.cancel = False  # the frozen prefill answers nothing that promises
    w.client.gone = True
    touched = polls_until(w.role, lambda: req.finished)
    assert touched == [req] and "stopped answering" in req.finished_reason.message  # type: ignore[union-attr,operator]
    assert w.receiver.cut == [PREFILL] and w.client.forgotten == [("10.0.0.1", 8998)]
    if not w.transfer.one_sided:
        assert w.kv.is_all_free()  # tcp: nothing lands past our door
        return
    polls_until(w.role, lambda: len(w.client.cancels) >= 3)  # asked again each interval
    assert not w.kv.is_all_free() and w.role.stats.quarantined_pages == 3
    w.arrive(req)  # it wakes up and finishes its write: into pages nobody else has
    polls_until(w.role, w.kv.is_all_free)
    assert w.role.stats.kv_plane == {"late_write_contained": 1}


def test_a_landing_write_holds_the_pages_until_it_ends(w: World) -> None:
    if w.transfer.one_sided:
        pytest.skip("a one-sided write has no landing to see")
    req = request("r8", 8)
    w.registered(req)
    assert w.fence.admit(8, list(req.kv.pages), PREFILL)  # the receiver is filling them
    w.role.abort("r8", "client left")
    w.role.poll()
    assert req.finished and not w.kv.is_all_free()
    w.fence.landed(8, False)  # the link broke off mid-room
    w.role.poll()
    assert w.kv.is_all_free() and not w.fence.admit(8, [0, 1, 2], PREFILL)


def test_abort_and_duplicates(w: World) -> None:
    req = request("r9", 9)
    w.role.add(req)
    with pytest.raises(RoomInUse):
        w.role.add(request("other", 9))
    assert w.role.abort("r9", "client left") is True
    assert w.role.poll() == [req] and req.finished_reason.kind == "abort"  # type: ignore[union-attr]
    assert w.role.abort("r9", "again") is False and w.kv.is_all_free()
    assert w.role.abort("nobody", "x") is False  # not ours, not the scheduler's
