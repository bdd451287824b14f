"""The decode side's write fence (docs/kv-plane.md): which pages a write for a room may touch,
and which one prefill may write them.

A room is `expect`ed with its exact pages and the prefill that may write them (or named later,
`bind_peer`), until it `arrive`s or is `revoke`d; then it is `discard`ed. Every check and every
state change is made under one lock, so a write is admitted (`admit`) only into the pages of a
room that is expected, not revoked and written by its own prefill, and `revoke` closes that door
and says whether a write is under way. A transfer backend only moves bytes: one whose writes
pass our receiver (tcp) asks `admit` before a write and says `landed` after; a one-sided one
(nixl) cannot ask, and the decode role waits for the prefill's word instead.
`on_arrival` (the scheduler loop's wake-up) is called, from whichever thread saw it, when a
room's KV is in place or a revoked room's write is over.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from runtime.disagg.wire import AuxRecord


@dataclass
class _Expected:
    """A room the decode side waits for: the only pages a write for it may touch, and the one
    prefill instance that may write them."""

    pages: list[int]
    given: str | None  # the prefill named by `expect` (the ticket's), if any
    peer: str | None  # None until the prefill's instance id is known (bind_peer)
    landing: bool = False  # tcp: the receiver is filling its pages right now
    written: bool = False  # tcp: a write filled every page (its RoomDone may count)
    revoked: bool = False  # the room ended: no write for it is admitted any more


class WriteFence:
    def __init__(self, on_arrival: Callable[[], None] = lambda: None) -> None:
        self.on_arrival = on_arrival
        self._rooms: dict[int, _Expected] = {}
        self._arrived: dict[int, AuxRecord] = {}
        self._lock = threading.Lock()
        self._expecting = threading.Event()  # set by expect(): a room may arrive now

    def expect(self, room: int, pages: list[int], peer: str | None = None) -> None:
        """`room`'s `pages` may be written from now on, by prefill `peer` (or the one
        `bind_peer` names), until it arrived or is revoked."""
        with self._lock:
            self._rooms[room] = _Expected(list(pages), peer, peer)
        self._expecting.set()

    def expecting(self, timeout: float) -> bool:
        """Whether some room is expected; with none, waits up to `timeout` for one (a
        backend's progress thread sleeps here)."""
        if not self._rooms:
            self._expecting.wait(timeout)
            self._expecting.clear()
        return bool(self._rooms)

    def bind_peer(self, room: int, peer: str) -> bool:
        """Name the prefill that may write `room` if none is named yet; False when the room is
        revoked or another prefill is named (the caller must not hand it the pages)."""
        with self._lock:
            e = self._rooms.get(room)
            if e is None or e.revoked:
                return False
            if e.peer is None:
                e.peer = peer
            return e.peer == peer

    def unbind_peer(self, room: int) -> None:
        """Undo `bind_peer` (the prefill it named refused the room: it never had the pages)."""
        with self._lock:
            e = self._rooms.get(room)
            if e is not None and not e.landing:
                e.peer = e.given

    def peer_of(self, room: int) -> str | None:
        """The prefill that may write `room` (None: not expected, or not known yet)."""
        with self._lock:
            e = self._rooms.get(room)
            return e.peer if e is not None else None

    def admit(self, room: int, pages: list[int], peer: str) -> bool:
        """A write of `pages` for `room` from `peer` may start: mark it landing (tcp)."""
        with self._lock:
            e = self._rooms.get(room)
            if e is None or e.revoked or e.landing or e.peer != peer or e.pages != pages:
                return False
            e.landing = True
            return True

    def landed(self, room: int, complete: bool) -> None:
        """The write `admit` let in is over: `complete`, or broken off."""
        with self._lock:
            e = self._rooms.get(room)
            if e is not None:
                e.landing, e.written = False, complete
            revoked = e is not None and e.revoked
        if revoked:
            self.on_arrival()  # the decode role may free the pages now

    def arrive(self, aux: AuxRecord, peer: str, written: bool = False) -> bool:
        """Every page of `aux.room` is in place: keep its aux record if the room is expected
        from `peer` (an ended room is not waited for: keeping it would leak) and, where asked
        (`written`), a complete write of its pages was admitted. A revoked room's record is
        kept too: for a one-sided backend it is the proof that its write is over."""
        with self._lock:
            e = self._rooms.get(aux.room)
            if e is None or e.peer != peer or aux.room in self._arrived:
                return False
            if written and not e.written:
                return False
            self._arrived[aux.room] = aux
        self.on_arrival()
        return True

    def arrived(self, room: int) -> AuxRecord | None:
        """The room's aux record once every page of it is in place, else None."""
        with self._lock:
            return self._arrived.get(room)

    def revoke(self, room: int) -> bool:
        """Admit no more writes for `room`; True when none is landing now, so its pages may be
        freed (for a one-sided backend that is not enough: see the module's note)."""
        with self._lock:
            e = self._rooms.get(room)
            if e is None:
                return True
            e.revoked = True
            return not e.landing

    def discard(self, room: int) -> None:
        """Forget `room` (it ended and its pages are freed or handed to the scheduler)."""
        with self._lock:
            self._rooms.pop(room, None)
            self._arrived.pop(room, None)
