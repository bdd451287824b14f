"""The room state machines of both roles: their states, their transition tables, and the one
helper that moves a room (`Machine.move`), which raises IllegalTransition for a move its table
does not list.

Every state of either side shows as one of the common phases (`RoomState`: the rooms gauge's
labels, docs/disaggregation.md): Bootstrapping -> WaitingForInput -> Transferring -> Success,
or Failed. A state the table gives no phase (a cancel) keeps the phase it came from. A state
with no way out is terminal; a room whose phase is Success or Failed has ended, and a late
failure of it is a no-op (`Room.fail` answers False), never an illegal move.

Prefill (runtime/disagg/prefill.py), one room:
  BOOTSTRAPPING -> WAITING_FOR_INPUT -> QUEUED -> WRITING -> SUCCESS
  CANCELLED (the decode cancelled before a write was queued: fails at the next poll)
  CANCELLED_QUEUED (cancelled after its write was queued: the sender's claim refuses it)
  FAILED from every state but SUCCESS
and, beside it, its request's stage with the scheduler (`Stage`): PENDING -> SCHEDULED ->
HANDED_OFF, or PENDING -> HANDED_OFF for a request adopted with its KV (runtime/disagg/move.py).

Decode (runtime/disagg/decode.py), one room:
  PREALLOC -> RESERVED -> REGISTERING -> WAITING_FOR_INPUT -> TRANSFERRING -> SUCCESS
  and three failed states, which say what the prefill may still do to the room's pages (the
  fence, docs/kv-plane.md): FAILED_UNSEEN (it never had them), FAILED (it may still write
  them), FAILED_SETTLED (it said its last word: its KV or a RoomFailed came). FAILED and
  FAILED_UNSEEN go on to FAILED_SETTLED when a RoomFailed comes late.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar


class RoomState(enum.Enum):
    """The phase a room is in, common to both sides (the rooms gauge counts by it)."""

    BOOTSTRAPPING = "bootstrapping"  # waiting for the peer (prefill: decode's pages; decode: route)
    WAITING_FOR_INPUT = "waiting_for_input"  # pages known / reserved, KV not computed yet
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (RoomState.SUCCESS, RoomState.FAILED)


class IllegalTransition(RuntimeError):
    """A move its state machine's table does not list: a bug in the role, never a peer's doing."""


S = TypeVar("S", bound=enum.Enum)


@dataclass(frozen=True)
class Machine(Generic[S]):
    """A transition table: each state -> the states it may go to (none: terminal)."""

    start: S
    moves: Mapping[S, frozenset[S]]
    failed: S | None = None  # where `Room.fail` goes
    phases: Mapping[S, RoomState] = field(default_factory=dict)  # a state not here keeps its phase

    def move(self, was: S, to: S) -> S:
        """`to`, when the table lets `was` go there; else IllegalTransition."""
        if to not in self.moves[was]:
            raise IllegalTransition(f"{type(was).__name__}: {was.name} -> {to.name}")
        return to

    def terminal(self, state: S) -> bool:
        return not self.moves[state]


class PrefillState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"  # the request or the decode's pages is here, not both
    WAITING_FOR_INPUT = "waiting_for_input"  # both: waits for the scheduler's hand-off
    QUEUED = "queued"  # its write waits for the sender
    WRITING = "writing"  # the sender claimed it: a write is under way or done
    CANCELLED = "cancelled"  # the decode cancelled before a write was queued
    CANCELLED_QUEUED = "cancelled_queued"  # cancelled with its write queued: never written
    SUCCESS = "success"
    FAILED = "failed"


_P = PrefillState
PREFILL = Machine(
    start=_P.BOOTSTRAPPING,
    moves={
        _P.BOOTSTRAPPING: frozenset({_P.WAITING_FOR_INPUT, _P.CANCELLED, _P.FAILED}),
        _P.WAITING_FOR_INPUT: frozenset({_P.QUEUED, _P.CANCELLED, _P.FAILED}),
        # the sender's claim: WRITING, or it refuses an expired room (FAILED once it answered)
        _P.QUEUED: frozenset({_P.WRITING, _P.CANCELLED_QUEUED, _P.FAILED}),
        _P.WRITING: frozenset({_P.SUCCESS, _P.FAILED}),  # a cancel no longer stops it
        _P.CANCELLED: frozenset({_P.FAILED}),
        _P.CANCELLED_QUEUED: frozenset({_P.FAILED}),
        _P.SUCCESS: frozenset(),
        _P.FAILED: frozenset(),
    },
    failed=_P.FAILED,
    phases={
        _P.BOOTSTRAPPING: RoomState.BOOTSTRAPPING,
        _P.WAITING_FOR_INPUT: RoomState.WAITING_FOR_INPUT,
        _P.QUEUED: RoomState.TRANSFERRING,
        _P.WRITING: RoomState.TRANSFERRING,
        _P.SUCCESS: RoomState.SUCCESS,
        _P.FAILED: RoomState.FAILED,
    },
)


# where a cancel from the decode takes a prefill room that has no write under way
PREFILL_CANCELS: Mapping[PrefillState, PrefillState] = {
    _P.BOOTSTRAPPING: _P.CANCELLED,
    _P.WAITING_FOR_INPUT: _P.CANCELLED,
    _P.QUEUED: _P.CANCELLED_QUEUED,
}
# the live states whose write went to the sender (its future answers)
PREFILL_SENDING = frozenset({_P.QUEUED, _P.WRITING, _P.CANCELLED_QUEUED})


class Stage(enum.Enum):
    """A prefill room's request with the scheduler."""

    PENDING = "pending"  # not given to it (yet, or no request yet)
    SCHEDULED = "scheduled"  # with it: its prefill runs; it frees the request's KV
    HANDED_OFF = "handed_off"  # it is done with it: the role owns the request and its KV


STAGE = Machine(
    start=Stage.PENDING,
    moves={
        Stage.PENDING: frozenset({Stage.SCHEDULED, Stage.HANDED_OFF}),  # the latter: adopted
        Stage.SCHEDULED: frozenset({Stage.HANDED_OFF}),
        Stage.HANDED_OFF: frozenset(),
    },
)


class DecodeState(enum.Enum):
    PREALLOC = "prealloc"  # waits for the pool to have room for its prompt
    RESERVED = "reserved"  # its pages are taken at a KV fence; waits for the fence to pass
    REGISTERING = "registering"  # POST /rooms went out: the prefill may know our pages
    WAITING_FOR_INPUT = "waiting_for_input"  # the prefill took the room: it may write them
    TRANSFERRING = "transferring"  # (passed through) every page is in place, with its aux record
    SUCCESS = "success"
    FAILED_UNSEEN = "failed_unseen"  # failed; the prefill never had our pages
    FAILED = "failed"  # failed; the prefill may still write our pages (nixl: quarantined)
    FAILED_SETTLED = "failed_settled"  # failed; the prefill said its last word on the room


_D = DecodeState
DECODE = Machine(
    start=_D.PREALLOC,
    moves={
        _D.PREALLOC: frozenset({_D.RESERVED, _D.FAILED_UNSEEN}),
        _D.RESERVED: frozenset({_D.REGISTERING, _D.FAILED_UNSEEN}),
        # refused: unseen; no answer (or an ambiguous one): it may have them
        _D.REGISTERING: frozenset({_D.WAITING_FOR_INPUT, _D.FAILED_UNSEEN, _D.FAILED,
                                   _D.FAILED_SETTLED}),
        _D.WAITING_FOR_INPUT: frozenset({_D.TRANSFERRING, _D.FAILED, _D.FAILED_SETTLED}),
        _D.TRANSFERRING: frozenset({_D.SUCCESS, _D.FAILED_SETTLED}),  # its KV is here
        _D.SUCCESS: frozenset(),
        _D.FAILED_UNSEEN: frozenset({_D.FAILED_SETTLED}),  # a RoomFailed came late
        _D.FAILED: frozenset({_D.FAILED_SETTLED}),
        _D.FAILED_SETTLED: frozenset(),
    },
    failed=_D.FAILED,
    phases={
        _D.PREALLOC: RoomState.BOOTSTRAPPING,
        _D.RESERVED: RoomState.BOOTSTRAPPING,
        _D.REGISTERING: RoomState.BOOTSTRAPPING,
        _D.WAITING_FOR_INPUT: RoomState.WAITING_FOR_INPUT,
        _D.TRANSFERRING: RoomState.TRANSFERRING,
        _D.SUCCESS: RoomState.SUCCESS,
        _D.FAILED_UNSEEN: RoomState.FAILED,
        _D.FAILED: RoomState.FAILED,
        _D.FAILED_SETTLED: RoomState.FAILED,
    },
)

# where a failure of a live decode room goes: what the prefill may know of its pages then
DECODE_FAILS_TO: Mapping[DecodeState, DecodeState] = {
    _D.PREALLOC: _D.FAILED_UNSEEN,
    _D.RESERVED: _D.FAILED_UNSEEN,
    _D.REGISTERING: _D.FAILED,  # the POST may have reached it
    _D.WAITING_FOR_INPUT: _D.FAILED,
    _D.TRANSFERRING: _D.FAILED_SETTLED,
}
# live, with its pages taken (the prealloc queue keeps their reserve)
DECODE_RESERVING = frozenset({_D.RESERVED, _D.REGISTERING, _D.WAITING_FOR_INPUT, _D.TRANSFERRING})
# live, and the prefill may know our pages (its heartbeats are watched)
DECODE_EXPOSED = frozenset({_D.REGISTERING, _D.WAITING_FOR_INPUT, _D.TRANSFERRING})
