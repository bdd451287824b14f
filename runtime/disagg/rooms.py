"""Bootstrap rooms: the states one request's KV handoff goes through, on either side.

Bootstrapping -> WaitingForInput -> Transferring -> Success, or Failed from any of them; a
terminal state never changes (Failed wins over anything that comes later, and Success is not
undone by a late error).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

log = logging.getLogger(__name__)


class RoomState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"  # waiting for the peer (prefill: decode's pages; decode: route)
    WAITING_FOR_INPUT = "waiting_for_input"  # pages known / reserved, KV not computed yet
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (RoomState.SUCCESS, RoomState.FAILED)


class RoomError(ValueError):
    """A request whose bootstrap fields cannot work here (missing, malformed): a 400."""

    status = 400


class RoomInUse(RoomError):
    """A room that this server already has in flight (a client-supplied duplicate): a 409."""

    status = 409


@dataclass
class Room:
    room: int
    state: RoomState = RoomState.BOOTSTRAPPING
    since: float = field(default_factory=time.monotonic)  # when it entered `state`
    created: float = field(default_factory=time.monotonic)
    reason: str | None = None  # why it failed

    def advance(self, state: RoomState) -> bool:
        """Move to `state` unless already terminal; False when the move did not happen."""
        if self.state.terminal:
            return False
        self.state, self.since = state, time.monotonic()
        log.debug("room %d: %s at +%.1f ms", self.room, state.value, 1e3 * (self.since - self.created))
        return True

    def fail(self, reason: str) -> bool:
        if self.advance(RoomState.FAILED):
            self.reason = reason
            return True
        return False

    def waited(self, now: float | None = None) -> float:
        return (now if now is not None else time.monotonic()) - self.since


def count_states(rooms: Iterable[Room]) -> dict[str, int]:
    """How many rooms are in each state (for the rooms-by-state gauge)."""
    counts: dict[str, int] = {}
    for room in rooms:
        counts[room.state.value] = counts.get(room.state.value, 0) + 1
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
