"""Choosing the (prefill, decode) pair for a request: round_robin | least_load | cache_aware.

A policy sees only ready workers that have a partner (`Workers.pairable`, never an empty list)
and, when it `wants_ids`, the request's prompt token ids (None when the router cannot tell them)
and its cache salt (the prefix cache's namespace: KV is reused only within one);
it picks a prefill that has an allowed partner, then a decode among its allowed partners (the
same KV layout and backend, a pair not quarantined, not one a retry avoids). It must not block.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from runtime.router.config import PolicyName, Role, RouterConfig
from runtime.router.kv_index import KVIndex
from runtime.router.workers import Worker

Allowed = Callable[[Worker, Worker], bool]  # may this (prefill, decode) pair take a request?


def same_kv(prefill: Worker, decode: Worker) -> bool:
    return prefill.kv_transfer == decode.kv_transfer


class Policy(ABC):
    wants_ids = False  # the router tokenizes the prompt only for a policy that reads it

    def pick(
        self, prefill: Sequence[Worker], decode: Sequence[Worker], ids: list[int] | None = None,
        allowed: Allowed = same_kv, salt: str | None = None,
    ) -> tuple[Worker, Worker]:
        """A prefill that has an allowed partner, then one of its allowed partners (the
        caller makes sure there is one)."""
        p = self.pick_prefill([w for w in prefill if any(allowed(w, d) for d in decode)], ids,
                              salt)
        d = self.pick_decode([w for w in decode if allowed(p, w)])
        p.picks += 1
        d.picks += 1
        return p, d

    @abstractmethod
    def pick_prefill(self, workers: Sequence[Worker], ids: list[int] | None,
                     salt: str | None = None) -> Worker: ...

    @abstractmethod
    def pick_decode(self, workers: Sequence[Worker]) -> Worker: ...


def load(worker: Worker) -> tuple[int, int]:
    """How busy a worker is for this router: requests in flight, then how often it was picked."""
    return worker.in_flight, worker.picks


def least_loaded(workers: Sequence[Worker]) -> Worker:
    """Fewest requests in flight from this router; ties go to the one picked least often."""
    return min(workers, key=load)


class RoundRobin(Policy):
    """Each role has its own cursor over its ready workers."""

    def __init__(self) -> None:
        self.cursor: dict[Role, int] = {"prefill": 0, "decode": 0}

    def _next(self, role: Role, workers: Sequence[Worker]) -> Worker:
        worker = workers[self.cursor[role] % len(workers)]
        self.cursor[role] += 1
        return worker

    def pick_prefill(self, workers: Sequence[Worker], ids: list[int] | None,
                     salt: str | None = None) -> Worker:
        return self._next("prefill", workers)

    def pick_decode(self, workers: Sequence[Worker]) -> Worker:
        return self._next("decode", workers)


class LeastLoad(Policy):
    def pick_prefill(self, workers: Sequence[Worker], ids: list[int] | None,
                     salt: str | None = None) -> Worker:
        return least_loaded(workers)

    def pick_decode(self, workers: Sequence[Worker]) -> Worker:
        return least_loaded(workers)


class CacheAware(Policy):
    """Prefill: the lowest cost, where cost = the prompt tokens a worker would compute (those
    its prefix cache does not hold, by the KV index its events keep) + `load_tokens` for each
    request it has in flight from this router; ties go to the one picked least often. Without
    prompt ids (no tokenizer for a text prompt): least_load. Decode: least_load."""

    wants_ids = True

    def __init__(self, index: KVIndex, load_tokens: int) -> None:
        self.index = index
        self.load_tokens = load_tokens

    def pick_prefill(self, workers: Sequence[Worker], ids: list[int] | None,
                     salt: str | None = None) -> Worker:
        if not ids:
            return least_loaded(workers)

        def cost(w: Worker) -> tuple[int, int]:
            uncached = len(ids) - self.index.cached_tokens(w.url, ids, salt)
            return uncached + self.load_tokens * w.in_flight, w.picks

        worker = min(workers, key=cost)
        self.index.expect(worker.url, ids, salt)
        return worker

    def pick_decode(self, workers: Sequence[Worker]) -> Worker:
        return least_loaded(workers)


def build_policy(name: PolicyName, config: RouterConfig, index: KVIndex) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    return CacheAware(index, config.cache_load_tokens)  # cache_aware, and prefix (its alias)
