"""Decode -> prefill heartbeats: a prefill that stops answering is declared gone.

Every --heartbeat-interval-s the decode role asks each prefill it waits on for `/health` (on a
worker thread); after --heartbeat-misses failures in a row, its rooms fail at once and their
pages are freed (a dead process writes nothing more).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from runtime.config import DisaggConfig

Address = tuple[str, int]


class Heartbeats:
    def __init__(
        self,
        alive: Callable[[Address], bool],
        workers: ThreadPoolExecutor,
        config: DisaggConfig,
        wake: Callable[[], None],
    ) -> None:
        self.alive, self.workers, self.config, self.wake = alive, workers, config, wake
        self.misses: dict[Address, int] = {}
        self.pending: dict[Address, Future[bool]] = {}
        self.next_at = 0.0

    def check(self, watched: set[Address]) -> list[Address]:
        """Collect answers, send the next round when due; returns the addresses declared gone."""
        gone = []
        for addr, answer in list(self.pending.items()):
            if not answer.done():
                continue
            del self.pending[addr]
            ok = answer.exception() is None and answer.result()
            self.misses[addr] = 0 if ok else self.misses.get(addr, 0) + 1
            if self.misses[addr] >= self.config.heartbeat_misses and addr in watched:
                gone.append(addr)
                del self.misses[addr]
        for addr in set(self.misses) - watched:
            del self.misses[addr]
        now = time.monotonic()
        if now >= self.next_at:
            self.next_at = now + self.config.heartbeat_interval_s
            for addr in watched - set(self.pending):
                self.pending[addr] = self.workers.submit(self.alive, addr)
                self.pending[addr].add_done_callback(lambda _: self.wake())
        return gone
