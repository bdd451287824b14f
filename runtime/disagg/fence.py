"""The decode side's write fence (docs/kv-plane.md): which pages a write for a room may touch,
and which one prefill may write them.

A room is `expect`ed with its exact pages and the prefill that may write them (or named later,
`bind_peer`), until it `arrive`s or is `revoke`d; then it is `discard`ed. Every check and every
state change is made under one lock, so a write is admitted (`admit`) only into the pages of a
room that is expected, not revoked and written by its own prefill, and `revoke` closes that door
and says whether a write is under way. A transfer backend only moves bytes: one whose writes
pass our receiver (tcp) asks `admit` before a write and says `landed` after; a one-sided one
(nixl) cannot ask, and the decode role waits for the prefill's word instead. A one-sided write
is still counted: its completion notification asks `admit` and says `landed` at once, after
its bytes (a refused one landed all the same, but counts for nothing).
`on_arrival` (the scheduler loop's wake-up) is called, from whichever thread saw it, when a
room's KV is in place or a revoked room's write is over.

Under tensor parallelism (runtime/disagg/shares.py) a room's pages on one rank may be written by
several prefill ranks, each its share of the KV heads, each on its own link: `bind_peer` names
those `sources`, and each is admitted and lands on its own. The RoomDone comes on prefill rank
0's link behind its share only (tcp), or once every prefill rank's WRITE is over but maybe
before their notifications (nixl), so when it finds another share still to land, its aux
record waits (`done`) until the last one has. The decode's rank 0 also waits for its other ranks
(`others`: their fences, runtime/disagg/ranks_plane.py, report their shares in place) and, on
revoke, for each to confirm that no write is landing there (`unclosed`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.disagg.shares import Share, sources
from runtime.disagg.wire import AuxRecord

ONE = frozenset({0})  # one prefill rank writes every head of the page


@dataclass
class _Expected:
    """A room the decode side waits for: the only pages a write for it may touch, and the one
    prefill instance that may write them."""

    pages: list[int]
    given: str | None  # the prefill named by `expect` (the ticket's), if any
    peer: str | None  # None until the prefill's instance id is known (bind_peer)
    sources: frozenset[int] = ONE  # the prefill ranks whose shares land here
    shared: bool = False  # moved as shares (either side has several ranks): a RoomDone follows
    landing: set[int] = field(default_factory=set)  # tcp: sources filling their share now
    written: set[int] = field(default_factory=set)  # tcp: sources whose share filled every page
    revoked: bool = False  # the room ended: no write for it is admitted any more
    done: AuxRecord | None = None  # its RoomDone, come before another link's share landed
    others: set[int] = field(default_factory=set)  # rank 0: other ranks still waiting for KV
    unclosed: set[int] = field(default_factory=set)  # rank 0, revoked: ranks yet to close

    def complete(self) -> bool:
        return self.sources <= self.written and not self.others


class WriteFence:
    def __init__(self, on_arrival: Callable[[], None] = lambda: None, rank: int = 0) -> None:
        """`rank`: which of the decode's TP ranks this fence guards."""
        self.on_arrival, self.rank = on_arrival, rank
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

    def bind_peer(self, room: int, peer: str, shares: list[Share] | None = None) -> bool:
        """Name the prefill that may write `room` if none is named yet, and which of its ranks
        write here (`shares`: the room's, when either side has several ranks); False when the
        room is revoked or another prefill is named (the caller must not hand it the pages)."""
        with self._lock:
            e = self._rooms.get(room)
            if e is None or e.revoked:
                return False
            if e.peer is None:
                e.peer = peer
            if e.peer == peer and not e.landing:
                e.sources = ONE if shares is None else sources(shares, self.rank)
                e.shared = shares is not None
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

    def admit(self, room: int, pages: list[int], peer: str, source: int = 0) -> bool:
        """A write of `pages` for `room` from `peer`'s rank `source` may start: mark it
        landing (tcp)."""
        with self._lock:
            e = self._rooms.get(room)
            if (e is None or e.revoked or source in e.landing or e.peer != peer
                    or e.pages != pages or source not in e.sources):
                return False
            e.landing.add(source)
            return True

    def landed(self, room: int, complete: bool, source: int = 0) -> None:
        """The write `admit` let in is over: `complete`, or broken off."""
        with self._lock:
            e = self._rooms.get(room)
            if e is not None:
                e.landing.discard(source)
                if complete:
                    e.written.add(source)
                else:
                    e.written.discard(source)
            wake = e is not None and (e.revoked or self._release(room, e))
        if wake:
            self.on_arrival()  # the decode role may free the pages now, or take the KV

    def _release(self, room: int, e: _Expected) -> bool:
        """Under the lock: a waiting RoomDone's room is now complete: it arrives."""
        if e.done is None or not e.complete() or e.revoked:
            return False
        self._arrived[room], e.done = e.done, None
        return True

    def arrive(self, aux: AuxRecord, peer: str, written: bool = False) -> bool:
        """`aux.room`'s record came: keep it if the room is expected from `peer` (an ended room
        is not waited for: keeping it would leak). It arrives (`arrived`) once every page of
        the room is in place:
        - `written` (tcp): it came behind rank 0's share on that link, which must have been
          admitted and landed complete; it waits for the other shares;
        - else (one-sided): nixl delivered it after every byte of the room's WRITEs; moved as
          shares, only after their WRITEs were over, and it waits for their notifications. A
          revoked room's record is kept at once: it is the proof that its writes are over."""
        with self._lock:
            e = self._rooms.get(aux.room)
            if e is None or e.peer != peer or aux.room in self._arrived or e.done is not None:
                return False
            if written and 0 not in e.written:  # rank 0's share came first on this link
                return False
            if not e.complete() and (written or (e.shared and not e.revoked)):
                e.done = aux  # another share is still to land
                return True
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
            return not e.landing and not e.unclosed

    def discard(self, room: int) -> None:
        """Forget `room` (it ended and its pages are freed or handed to the scheduler)."""
        with self._lock:
            self._rooms.pop(room, None)
            self._arrived.pop(room, None)
