"""The write fence on its own (runtime/disagg/fence.py): who it wakes and when; what a late or
foreign write gets. The receiver's side of it, over real links: test_kv_plane.py."""

from __future__ import annotations

import threading
import time

from runtime.disagg.fence import WriteFence
from runtime.disagg.wire import AuxRecord

P, Q = "baton-prefill-P", "baton-prefill-Q"


def aux(room: int) -> AuxRecord:
    return AuxRecord(room, f"r{room}", 3, 42)


def test_a_sleeping_progress_thread_wakes_when_a_room_is_expected() -> None:
    fence = WriteFence()
    start = time.monotonic()
    assert fence.expecting(0.05) is False and time.monotonic() - start >= 0.04
    threading.Timer(0.05, fence.expect, (1, [0, 1], P)).start()
    start = time.monotonic()
    assert fence.expecting(5.0) is True
    assert time.monotonic() - start < 2.0  # woken by expect(), not by the timeout
    assert fence.expecting(5.0) is True  # while one is expected it never sleeps


def test_arrivals_wake_the_loop_and_only_the_named_prefill_counts() -> None:
    woken: list[int] = []
    fence = WriteFence(lambda: woken.append(1))
    fence.expect(1, [0, 1], P)
    assert not fence.arrive(aux(1), Q) and not woken  # not the prefill it expects
    assert not fence.arrive(aux(2), P)  # a room nobody expects is not kept (it would leak)
    assert fence.arrive(aux(1), P) and woken == [1]
    assert fence.arrived(1) == aux(1) and not fence.arrive(aux(1), P)  # once
    fence.discard(1)
    assert fence.arrived(1) is None and fence.peer_of(1) is None


def test_a_revoked_room_admits_nothing_and_its_landing_write_wakes_the_loop() -> None:
    woken: list[int] = []
    fence = WriteFence(lambda: woken.append(1))
    fence.expect(1, [3, 4])  # the prefill is named later (bind_peer)
    assert not fence.admit(1, [3, 4], P)  # nobody named yet
    assert fence.bind_peer(1, P) and not fence.bind_peer(1, Q)
    assert not fence.admit(1, [3, 5], P)  # not its pages
    assert fence.admit(1, [3, 4], P) and not fence.admit(1, [3, 4], P)  # one write at a time
    assert fence.revoke(1) is False  # a write is landing: the pages stay
    fence.landed(1, complete=False)
    assert woken == [1]  # the decode may free them now
    assert fence.revoke(1) is True and not fence.admit(1, [3, 4], P)
    assert not fence.arrive(aux(1), P, written=True)  # no complete write was admitted
