"""Decode -> prefill heartbeats: a prefill that stops answering is declared gone.

Every --heartbeat-interval-s the decode role asks each prefill it waits on for `/health` (on
that prefill's own lane, runtime/disagg/lanes.py); an answer that does not come within the
interval is a miss. After --heartbeat-misses misses in a row its rooms fail at once; their pages
are freed once no write for them can land (runtime/disagg/decode.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

from runtime.config import DisaggConfig

Address = tuple[str, int]


class Heartbeats:
    def __init__(
        self,
        alive: Callable[[Address], bool],
        submit: Callable[[Address, Callable[[Address], bool]], Future[bool]],
        config: DisaggConfig,
        wake: Callable[[], None],
    ) -> None:
        self.alive, self.submit, self.config, self.wake = alive, submit, config, wake
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
                self.pending[addr] = self.submit(addr, self.alive)
                self.pending[addr].add_done_callback(lambda _: self.wake())
        return gone
