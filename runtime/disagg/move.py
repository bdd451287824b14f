"""Drain by moving KV (docs/disaggregation.md "Moving a request"): a draining decode hands each
running stream the router follows to another decode, KV and all, with nothing recomputed.

When the decode drains, every decoding request whose client can follow it (`allow_kv_move`, set
by the router) is handed over with its next token (`Handoffs.hand_off_running`). Each one is
split (`Req.split_off`): the request its client knows ends here with the tokens due to it and a
"moved" finish whose `KVOffer` names a fresh room on this server's bootstrap port (its stream
ends with that hand-over, runtime/handover.py); the split-off request, which holds the KV of the
prompt and of every output token but the newest, waits in that room as a prefill's request
waits for its decode. The decode the router picks asks for the room
(POST /rooms) and gets the pages and the newest token over the usual transfer path, and
`process_prebuilt` continues it there. The sending side is a `PrefillRole` of its own; the pages
leave only once every forward launched before the hand-over has finished (one in flight may
still write the newest token's slot). A room nobody asks for frees its pages at the bootstrap
timeout or at shutdown; the router then replays the tokens instead (docs/router.md "Migration").
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol

from runtime.disagg.interfaces import R
from runtime.disagg.prefill import PrefillRole
from runtime.disagg.rooms import Room
from runtime.handover import KVOffer

log = logging.getLogger(__name__)

class MovingHandoffs(Protocol[R]):
    """The scheduler's PD edge as a draining decode uses it (runtime/scheduler/handoff.py)."""

    def hand_off_running(self, pick: Callable[[R], bool]) -> None: ...

    def take_handed_off(self) -> list[R]: ...

    def kv_fence(self) -> int: ...


@dataclass
class Mover(Generic[R]):
    handoffs: MovingHandoffs[R]
    sender: PrefillRole[R]  # with its bootstrap server: where the other decode asks
    host: str  # the bootstrap server's address as peers reach it
    draining: bool = False
    moved: int = 0  # since start

    def drain(self) -> None:
        self.draining = True

    def poll(self) -> list[R]:
        """Hand over what the scheduler let go, and advance the rooms; returns the requests
        whose clients are now told where they went (to emit)."""
        if not self.draining:
            return []
        self.handoffs.hand_off_running(lambda req: req.movable)
        told = []
        for req in self.handoffs.take_handed_off():
            room = secrets.randbits(63)
            moved = req.split_off(f"{req.rid}.moved", room, self.offer(room))
            self.sender.adopt(moved, self.handoffs.kv_fence())
            self.moved += 1
            log.info("%s: KV of %d tokens offered in room %d", req.rid,
                     len(moved.origin_input_ids), room)
            told.append(req)
        self.sender.poll()  # what it ends is nobody's client's: nothing to emit
        return told

    def offer(self, room: int) -> KVOffer:
        """Where the KV waits: `room` on this decode's bootstrap server."""
        bootstrap = self.sender.bootstrap
        assert bootstrap is not None
        return KVOffer(self.host, bootstrap.port, room, self.sender.instance_id)

    def rooms(self) -> list[Room]:
        """The rooms of moved requests (in the decode's room counts)."""
        with self.sender.lock:
            return [r.room for r in self.sender.rooms.values()]

    def has_work(self) -> bool:
        return self.sender.has_work()

    def close(self) -> None:
        self.sender.close()  # its writes and bootstrap port; the transfer is the decode's
