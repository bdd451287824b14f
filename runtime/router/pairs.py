"""Health per (prefill, decode) pair: a broken P<->D link takes that pair out, not its workers.

Worker health (`health.py`) says whether a worker answers at all. A pair can fail on its own:
the KV of P does not reach D (a partitioned link, a transport that does not work between those
two hosts) while both serve every other partner. The router counts, per pair, attempts that got
D's first answer (`succeeded`) and failures that blame the link (`failed`: a KV transfer that
failed or timed out):

    healthy --(`threshold` link failures in a row)--> quarantined
    quarantined --(its backoff has passed)--> probing: one request at a time may try it
    probing --success--> healthy (backoff reset) | --failure--> quarantined, backoff doubled

A request that a pair fails is retried on another pair (`exchange.py`), so a probe that fails
costs its client nothing. Everything runs on the router's event loop: no locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from runtime.router.workers import Worker

Key = tuple[str, str]  # (prefill URL, decode URL)


class PairState(IntEnum):
    """The value of the `baton_router_pair_state` gauge."""

    HEALTHY = 0
    PROBING = 1
    QUARANTINED = 2


@dataclass
class PairHealth:
    succeeded: int = 0
    failed: int = 0
    in_a_row: int = 0  # link failures since the last success
    backoff_s: float = 0.0  # the quarantine's length (0: never quarantined since healthy)
    until: float = 0.0  # time.monotonic() when the quarantine ends
    probing: bool = False  # a request is trying this pair after its quarantine
    latency_s: float | None = None  # moving average: request sent -> D's first answer
    last_error: str | None = None

    def state(self, now: float) -> PairState:
        if self.backoff_s == 0.0:
            return PairState.HEALTHY
        return PairState.QUARANTINED if now < self.until else PairState.PROBING


class PairTable:
    def __init__(self, threshold: int = 2, backoff_s: float = 5.0, max_backoff_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold, self.backoff_s, self.max_backoff_s = threshold, backoff_s, max_backoff_s
        self.clock = clock
        self.pairs: dict[Key, PairHealth] = {}

    def usable(self, prefill: Worker, decode: Worker) -> bool:
        """May a request go to this pair now? A pair past its quarantine takes one probe at
        a time."""
        health = self.pairs.get((prefill.url, decode.url))
        if health is None:
            return True
        state = health.state(self.clock())
        return state is PairState.HEALTHY or (state is PairState.PROBING and not health.probing)

    def probe_due(self, prefill: Worker, decode: Worker) -> bool:
        """Is this pair past its quarantine, waiting for its one probe?"""
        health = self.pairs.get((prefill.url, decode.url))
        return (health is not None and not health.probing
                and health.state(self.clock()) is PairState.PROBING)

    def sent(self, prefill: Worker, decode: Worker) -> bool:
        """A request goes to this pair: if the pair is on probation, it is the probe (True),
        and its sender owes the pair a verdict: `succeeded`, `failed` or `released`."""
        if self.probe_due(prefill, decode):
            self.pairs[prefill.url, decode.url].probing = True
            return True
        return False

    def succeeded(self, prefill: Worker, decode: Worker, latency_s: float) -> None:
        health = self.pairs.setdefault((prefill.url, decode.url), PairHealth())
        health.succeeded += 1
        health.in_a_row, health.backoff_s, health.probing = 0, 0.0, False
        health.latency_s = latency_s if health.latency_s is None else (
            0.8 * health.latency_s + 0.2 * latency_s)

    def failed(self, prefill: Worker, decode: Worker, why: str) -> None:
        """A failure that blames the link between these two (not one worker alone)."""
        health = self.pairs.setdefault((prefill.url, decode.url), PairHealth())
        now = self.clock()
        health.failed += 1
        health.in_a_row += 1
        health.last_error = why
        on_probation = health.state(now) is PairState.PROBING
        health.probing = False
        if on_probation or health.in_a_row >= self.threshold:
            health.backoff_s = min(self.max_backoff_s, max(self.backoff_s, 2 * health.backoff_s))
            health.until = now + health.backoff_s

    def released(self, prefill: Worker, decode: Worker) -> None:
        """A probe that ended without a verdict on the link (the client left, P failed)."""
        health = self.pairs.get((prefill.url, decode.url))
        if health is not None:
            health.probing = False

    def forget(self, worker: Worker) -> list[Key]:
        """Drop every pair of a worker that left; returns their keys."""
        gone = [key for key in self.pairs if worker.url in key]
        for key in gone:
            del self.pairs[key]
        return gone

    def states(self) -> dict[Key, PairState]:
        now = self.clock()
        return {key: health.state(now) for key, health in self.pairs.items()}

    def view(self, workers: dict[str, Worker] | None = None) -> list[dict[str, Any]]:
        """`GET /debug/pairs`: every pair that has seen a request, with each side's TP size and
        revision (`workers`: by URL; None where one has left)."""
        now, known = self.clock(), workers or {}

        def shown(url: str, what: str) -> Any:
            worker = known.get(url)
            return None if worker is None else getattr(worker, what)

        return [{"prefill": p, "decode": d, "prefill_tp": shown(p, "tp"),
                 "decode_tp": shown(d, "tp"), "prefill_revision": shown(p, "revision"),
                 "decode_revision": shown(d, "revision"),
                 "state": h.state(now).name.lower(),
                 "succeeded": h.succeeded, "failed": h.failed, "failures_in_a_row": h.in_a_row,
                 "backoff_s": h.backoff_s, "quarantine_left_s": round(max(0.0, h.until - now), 3),
                 "latency_s": None if h.latency_s is None else round(h.latency_s, 4),
                 "last_error": h.last_error}
                for (p, d), h in sorted(self.pairs.items())]
