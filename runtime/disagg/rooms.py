"""Bootstrap rooms: a role's record of one room (`Room`: its number and where its state machine,
runtime/disagg/states.py, has it), the role's table of them, and the errors a request's
bootstrap fields raise.

A room that has ended (its phase is Success or Failed) never fails again: Failed wins over
anything that comes later, and Success is not undone by a late error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from runtime.disagg.states import Machine, RoomState, S

log = logging.getLogger(__name__)


class RoomError(ValueError):
    """A request whose bootstrap fields cannot work here (missing, malformed): a 400."""

    status = 400


class RoomInUse(RoomError):
    """A room that this server already has in flight (a client-supplied duplicate): a 409."""

    status = 409


@dataclass(eq=False)
class Room(Generic[S]):
    """One room of a role: its number (the router's `bootstrap_room`) and where its state
    machine (runtime/disagg/states.py) has it."""

    number: int
    machine: Machine[S]
    state: S = field(init=False)
    phase: RoomState = field(init=False)
    since: float = field(default_factory=time.monotonic)  # when it entered its phase
    created: float = field(default_factory=time.monotonic)
    reason: str | None = None  # why it failed

    def __post_init__(self) -> None:
        self.state = self.machine.start
        self.phase = self.machine.phases.get(self.state, RoomState.BOOTSTRAPPING)

    @property
    def ended(self) -> bool:
        """Its phase is Success or Failed: it never fails again."""
        return self.phase.terminal

    def move(self, to: S) -> None:
        """Go to `to`; IllegalTransition when the table does not let it (runtime/disagg/states.py)."""
        self.state = self.machine.move(self.state, to)
        phase = self.machine.phases.get(to, self.phase)
        if phase is not self.phase:  # the timeouts count per phase
            self.phase, self.since = phase, time.monotonic()
        log.debug("room %d: %s at +%.1f ms", self.number, to.name, 1e3 * (self.since - self.created))

    def fail(self, reason: str, to: S | None = None) -> bool:
        """Fail it (into `to`, else its machine's failed state); False, and no move, when it
        has ended already (Failed wins, and Success is not undone by a late error)."""
        if self.ended:
            return False
        target = to if to is not None else self.machine.failed
        assert target is not None, "this machine has no failed state"
        self.move(target)
        self.reason = reason
        return True

    def waited(self, now: float | None = None) -> float:
        """How long it has been in its phase."""
        return (now if now is not None else time.monotonic()) - self.since


def count_states(rooms: Iterable[Room]) -> dict[str, int]:
    """How many rooms are in each phase (for the rooms-by-state gauge)."""
    counts: dict[str, int] = {}
    for room in rooms:
        counts[room.phase.value] = counts.get(room.phase.value, 0) + 1
    return counts


E = TypeVar("E")  # a role's record of one room


class RoomTable(Generic[E]):
    """A role's rooms, found by room number or by their request's rid (both roles keep one;
    the prefill's is shared with its bootstrap threads, under its lock)."""

    def __init__(self) -> None:
        self.rooms: dict[int, E] = {}
        self.rids: dict[str, int] = {}

    def get(self, room: int) -> E | None:
        return self.rooms.get(room)

    def setdefault(self, room: int, entry: E) -> E:
        return self.rooms.setdefault(room, entry)

    def name(self, rid: str, room: int) -> None:
        """`rid`'s request is in `room`."""
        self.rids[rid] = room

    def find(self, rid: str) -> E | None:
        room = self.rids.get(rid)
        return self.rooms.get(room) if room is not None else None

    def drop(self, room: int, rid: str | None) -> None:
        self.rooms.pop(room, None)
        if rid is not None:
            self.rids.pop(rid, None)

    def values(self) -> list[E]:
        return list(self.rooms.values())

    def __contains__(self, room: int) -> bool:
        return room in self.rooms

    def __len__(self) -> int:
        return len(self.rooms)
