"""The room state machines' tables (runtime/disagg/states.py), driven directly: the lives a room
may have are written out here, independently of the tables; each must walk, together they must
cover every edge of their table (so an edge added or dropped fails), every other move raises
IllegalTransition, and terminal states are final (a late failure of an ended room is a no-op)."""

from __future__ import annotations

import enum
import itertools
import time
from typing import Any

import pytest

from runtime.disagg.rooms import Room
from runtime.disagg.states import (
    DECODE,
    DECODE_EXPOSED,
    DECODE_FAILS_TO,
    DECODE_RESERVING,
    PREFILL,
    PREFILL_CANCELS,
    PREFILL_SENDING,
    STAGE,
    DecodeState,
    IllegalTransition,
    Machine,
    PrefillState,
    RoomState,
    Stage,
)

P = PrefillState
D = DecodeState

_TO_QUEUED = [P.BOOTSTRAPPING, P.WAITING_FOR_INPUT, P.QUEUED]
PREFILL_LIVES = [
    [*_TO_QUEUED, P.WRITING, P.SUCCESS],
    [P.BOOTSTRAPPING, P.FAILED],  # a bootstrap timeout, a refused room, an abort
    [P.BOOTSTRAPPING, P.CANCELLED, P.FAILED],
    [P.BOOTSTRAPPING, P.WAITING_FOR_INPUT, P.FAILED],  # the scheduler ended it, an abort
    [P.BOOTSTRAPPING, P.WAITING_FOR_INPUT, P.CANCELLED, P.FAILED],
    [*_TO_QUEUED, P.FAILED],  # the claim refused an expired room, or the link broke first
    [*_TO_QUEUED, P.CANCELLED_QUEUED, P.FAILED],
    [*_TO_QUEUED, P.WRITING, P.FAILED],  # the write failed (or may still land: in doubt)
]
STAGE_LIVES = [
    [Stage.PENDING, Stage.SCHEDULED, Stage.HANDED_OFF],
    [Stage.PENDING, Stage.HANDED_OFF],  # adopted with its KV (a draining decode's request)
]
_TO_REGISTERING = [D.PREALLOC, D.RESERVED, D.REGISTERING]
_TO_WAITING = [*_TO_REGISTERING, D.WAITING_FOR_INPUT]
DECODE_LIVES = [
    [*_TO_WAITING, D.TRANSFERRING, D.SUCCESS],
    [D.PREALLOC, D.FAILED_UNSEEN],  # a bootstrap timeout (no pages), an abort
    [D.PREALLOC, D.RESERVED, D.FAILED_UNSEEN],  # the KV fence never passed
    [*_TO_REGISTERING, D.FAILED_UNSEEN, D.FAILED_SETTLED],  # refused; its RoomFailed came late
    [*_TO_REGISTERING, D.FAILED, D.FAILED_SETTLED],  # no clear answer; then a RoomFailed
    [*_TO_REGISTERING, D.FAILED_SETTLED],  # a RoomFailed before its answer
    [*_TO_WAITING, D.FAILED],  # the KV did not come, an abort, its prefill gone
    [*_TO_WAITING, D.FAILED_SETTLED],  # a RoomFailed
    [*_TO_WAITING, D.TRANSFERRING, D.FAILED_SETTLED],  # a bad aux record, the KV canary
]
MACHINES: list[tuple[str, Machine[Any], list[list[Any]], set[Any]]] = [
    ("prefill", PREFILL, PREFILL_LIVES, {P.SUCCESS, P.FAILED}),
    ("stage", STAGE, STAGE_LIVES, {Stage.HANDED_OFF}),
    ("decode", DECODE, DECODE_LIVES, {D.SUCCESS, D.FAILED_SETTLED}),
]
ids = [name for name, *_ in MACHINES]


def edges(machine: Machine[Any]) -> set[tuple[Any, Any]]:
    return {(a, b) for a, tos in machine.moves.items() for b in tos}


def walked(lives: list[list[Any]]) -> set[tuple[Any, Any]]:
    return {pair for life in lives for pair in itertools.pairwise(life)}


@pytest.mark.parametrize(("name", "machine", "lives", "terminal"), MACHINES, ids=ids)
def test_every_life_walks_to_its_end(name: str, machine: Machine[Any], lives: list[list[Any]],
                                     terminal: set[Any]) -> None:
    for life in lives:
        assert life[0] is machine.start
        state = life[0]
        for to in life[1:]:
            state = machine.move(state, to)
            assert state is to
        ended = state in terminal or (state in machine.phases and machine.phases[state].terminal)
        assert ended, f"{name}: {life} ends in a live state"


@pytest.mark.parametrize(("name", "machine", "lives", "terminal"), MACHINES, ids=ids)
def test_the_lives_are_the_whole_table(name: str, machine: Machine[Any], lives: list[list[Any]],
                                       terminal: set[Any]) -> None:
    assert set(machine.moves) == set(type(machine.start)), f"{name}: a state without a row"
    assert edges(machine) == walked(lives)


@pytest.mark.parametrize(("name", "machine", "lives", "terminal"), MACHINES, ids=ids)
def test_every_other_move_raises(name: str, machine: Machine[Any], lives: list[list[Any]],
                                 terminal: set[Any]) -> None:
    states: list[enum.Enum] = list(type(machine.start))
    legal = walked(lives)
    for was, to in itertools.product(states, states):
        if (was, to) not in legal:
            with pytest.raises(IllegalTransition, match=f"{was.name} -> {to.name}"):
                machine.move(was, to)


@pytest.mark.parametrize(("name", "machine", "lives", "terminal"), MACHINES, ids=ids)
def test_terminal_states_are_final(name: str, machine: Machine[Any], lives: list[list[Any]],
                                   terminal: set[Any]) -> None:
    assert {s for s in machine.moves if machine.terminal(s)} == terminal
    for end, to in itertools.product(terminal, type(machine.start)):
        with pytest.raises(IllegalTransition):
            machine.move(end, to)


def test_no_way_back_to_bootstrapping() -> None:
    for was in P:
        if was is not P.BOOTSTRAPPING:
            with pytest.raises(IllegalTransition):
                PREFILL.move(was, P.BOOTSTRAPPING)
    for was in D:
        for to in (D.PREALLOC, D.RESERVED, D.REGISTERING):
            if (was, to) not in walked(DECODE_LIVES):
                with pytest.raises(IllegalTransition):
                    DECODE.move(was, to)


@pytest.mark.parametrize("end", [P.SUCCESS, P.FAILED])
def test_a_late_failure_of_an_ended_room_is_a_no_op(end: PrefillState) -> None:
    room = Room(7, PREFILL)
    for to in next(life for life in PREFILL_LIVES if life[-1] is end)[1:]:
        room.move(to)
    assert room.ended and room.fail("too late") is False
    assert room.state is end and room.reason is None
    with pytest.raises(IllegalTransition):
        room.move(P.FAILED)


def test_a_failure_of_a_live_room_moves_it_and_says_why() -> None:
    room = Room(8, PREFILL)
    room.move(P.WAITING_FOR_INPUT)
    assert room.fail("refused") is True
    assert (room.state, room.phase, room.reason) == (P.FAILED, RoomState.FAILED, "refused")


def test_phases_and_the_time_in_them() -> None:
    """Every state but a cancel has its phase; a cancel keeps the one it came from, and the
    clock of the timeouts (`waited`) restarts only when the phase changes."""
    assert set(PREFILL.phases) == set(P) - {P.CANCELLED, P.CANCELLED_QUEUED}
    room = Room(9, PREFILL)
    assert room.phase is RoomState.BOOTSTRAPPING
    room.move(P.WAITING_FOR_INPUT)
    room.move(P.QUEUED)
    since = room.since
    time.sleep(0.002)
    room.move(P.CANCELLED_QUEUED)
    assert (room.phase, room.since) == (RoomState.TRANSFERRING, since)
    room = Room(10, PREFILL)
    room.move(P.CANCELLED)
    assert room.phase is RoomState.BOOTSTRAPPING and not room.ended


def test_a_cancel_takes_only_a_room_whose_write_is_not_claimed() -> None:
    assert set(PREFILL_CANCELS) == {P.BOOTSTRAPPING, P.WAITING_FOR_INPUT, P.QUEUED}
    for was, to in PREFILL_CANCELS.items():
        assert PREFILL.move(was, to) is to
    assert {P.QUEUED, P.WRITING, P.CANCELLED_QUEUED} == PREFILL_SENDING


def test_a_late_failure_of_a_failed_decode_room_is_a_no_op() -> None:
    """Failed wins: a room that failed already (and may still be written) stays as it is,
    though the table lets FAILED go on to FAILED_SETTLED when a RoomFailed comes."""
    room = Room(11, DECODE)
    for to in _TO_WAITING[1:]:
        room.move(to)
    assert room.fail("the KV did not come") is True and room.state is D.FAILED
    assert room.fail("its prefill is gone") is False
    assert (room.state, room.reason) == (D.FAILED, "the KV did not come")


def test_a_decode_failure_says_what_the_prefill_may_know() -> None:
    live = {s for s in D if not DECODE.phases[s].terminal}
    assert set(DECODE_FAILS_TO) == live
    for was, to in DECODE_FAILS_TO.items():
        assert DECODE.move(was, to) is to and DECODE.phases[to] is RoomState.FAILED
    assert DECODE_FAILS_TO[D.RESERVED] is D.FAILED_UNSEEN  # never offered: never written
    assert DECODE_FAILS_TO[D.REGISTERING] is D.FAILED  # the offer may have reached it
    assert DECODE_RESERVING - {D.RESERVED} == DECODE_EXPOSED
    assert D.PREALLOC not in DECODE_RESERVING


def test_the_bootstrap_timeout_counts_from_the_room_s_creation() -> None:
    room = Room(12, DECODE)
    since = room.since
    time.sleep(0.002)
    room.move(D.RESERVED)
    room.move(D.REGISTERING)
    assert room.since == since and room.phase is RoomState.BOOTSTRAPPING
    room.move(D.WAITING_FOR_INPUT)
    assert room.since > since and room.phase is RoomState.WAITING_FOR_INPUT
