"""Choosing the (prefill, decode) pair for a request: round_robin | least_load | prefix.

A policy sees only ready workers that have a partner (`Workers.pairable`, never an empty list)
and the request's prompt text (None when it has none the router can read); the decode is picked
among those whose KV layout and backend match the chosen prefill's. It must not block.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from runtime.router.config import PolicyName, Role, RouterConfig
from runtime.router.prefix import PrefixIndex
from runtime.router.workers import Worker

# prefix: a matched prefill this many requests busier than the idlest one loses its affinity
IMBALANCE_SLACK = 16


class Policy(ABC):
    def pick(
        self, prefill: Sequence[Worker], decode: Sequence[Worker], prompt: str | None
    ) -> tuple[Worker, Worker]:
        p = self.pick_prefill(prefill, prompt)
        d = self.pick_decode([w for w in decode if w.kv_transfer == p.kv_transfer])
        p.picks += 1
        d.picks += 1
        return p, d

    @abstractmethod
    def pick_prefill(self, workers: Sequence[Worker], prompt: str | None) -> Worker: ...

    @abstractmethod
    def pick_decode(self, workers: Sequence[Worker]) -> Worker: ...


def least_loaded(workers: Sequence[Worker]) -> Worker:
    """Fewest requests in flight from this router; ties go to the one picked least often."""
    return min(workers, key=lambda w: (w.in_flight, w.picks))


class RoundRobin(Policy):
    """Each role has its own cursor over its ready workers."""

    def __init__(self) -> None:
        self.cursor: dict[Role, int] = {"prefill": 0, "decode": 0}

    def _next(self, role: Role, workers: Sequence[Worker]) -> Worker:
        worker = workers[self.cursor[role] % len(workers)]
        self.cursor[role] += 1
        return worker

    def pick_prefill(self, workers: Sequence[Worker], prompt: str | None) -> Worker:
        return self._next("prefill", workers)

    def pick_decode(self, workers: Sequence[Worker]) -> Worker:
        return self._next("decode", workers)


class LeastLoad(Policy):
    def pick_prefill(self, workers: Sequence[Worker], prompt: str | None) -> Worker:
        return least_loaded(workers)

    def pick_decode(self, workers: Sequence[Worker]) -> Worker:
        return least_loaded(workers)


class PrefixAffinity(Policy):
    """Prefill: the one that served the longest shared prefix of this prompt (its prefix cache
    likely holds it), if at least `min_chars` long and that worker is not overloaded; else
    least_load. Decode: least_load."""

    def __init__(self, min_chars: int, capacity: int):
        self.min_chars = min_chars
        self.index = PrefixIndex(capacity)

    def pick_prefill(self, workers: Sequence[Worker], prompt: str | None) -> Worker:
        if not prompt:
            return least_loaded(workers)
        worker = self._affine(workers, prompt) or least_loaded(workers)
        self.index.record(prompt, worker.url)
        return worker

    def pick_decode(self, workers: Sequence[Worker]) -> Worker:
        return least_loaded(workers)

    def _affine(self, workers: Sequence[Worker], prompt: str) -> Worker | None:
        by_url = {w.url: w for w in workers}
        url, matched = self.index.match(prompt, by_url)
        if url is None or matched < self.min_chars:
            return None
        worker = by_url[url]
        idlest = min(w.in_flight for w in workers)
        return worker if worker.in_flight - idlest < IMBALANCE_SLACK else None


def build_policy(name: PolicyName, config: RouterConfig) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    return PrefixAffinity(config.prefix_min_chars, config.prefix_capacity)
