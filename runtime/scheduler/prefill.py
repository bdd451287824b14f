"""PrefillAdder: which waiting requests join the next prefill, and how much of each.

Admission is by KV budget: a request joins if its chunk fits in the free pages left after
reserving room for the running requests to keep decoding (`new_token_ratio` of what they may still
generate, clipped). Estimates can be wrong; decode retracts when they are.
"""

from __future__ import annotations

from collections.abc import Iterable

from runtime.kvcache.manager import KVCacheManager
from runtime.scheduler.batch import ScheduleBatch
from runtime.scheduler.req import Req

DECODE_RESERVE_CLIP = 256  # tokens: reserve no more than this per request
# a prompt that shares at least this many uncached tokens with one being prefilled right now
# waits for it and reads them from the prefix cache (a shared chat-template header does not)
WAIT_FOR_SHARED_TOKENS = 64


def decode_reserve_tokens(reqs: Iterable[Req], ratio: float) -> int:
    return int(
        sum(
            min(r.sampling_params.max_new_tokens - len(r.output_ids), DECODE_RESERVE_CLIP)
            for r in reqs
        )
        * ratio
    )


class PrefillAdder:
    def __init__(
        self,
        kv: KVCacheManager,
        token_budget: int,
        max_new_reqs: int,
        reserved_tokens: int,
        ratio: float,
        nothing_running: bool,
    ) -> None:
        self.kv = kv
        self.budget = token_budget
        self.max_new_reqs = max_new_reqs
        self.ratio = ratio
        self.reserved_pages = kv.allocator.pages_for(reserved_tokens)
        self.claimed_pages = 0  # promised to the requests added so far (allocated at prepare)
        self.nothing_running = nothing_running
        self.batch = ScheduleBatch(mode="extend")
        self.chunked: Req | None = None  # the request left partially prefilled, if any
        self.rows_claimed = 0  # request slots the batch's requests take when they are grown

    def add(self, req: Req) -> bool:
        """Try to add (a chunk of) req; False means stop adding."""
        if len(self.batch) >= self.max_new_reqs or self.budget <= 0:
            return False
        if req.kv.row is None and self.kv.req_to_token.available <= self.rows_claimed:
            # every request slot is held, not only by running requests: a prefill's handed-off
            # requests keep theirs until their KV is sent, a decode's rooms while KV arrives
            return False
        fresh = not req.kv.pages  # from scratch (new, or retracted): from its cached prefix
        reused = self.kv.adopt_prefix(req) if fresh else 0
        if fresh and not req.is_retracted:
            req.cached_tokens = reused
        if not self._fits(req):
            if fresh:
                self.kv.release(req)  # waits unlocked: nothing it matched is pinned meanwhile
            return False
        if fresh:  # counted once it is admitted, not at every look while it waits
            self.kv.count_lookup(len(req.fill_ids), reused)
        return self._take(req)

    def should_wait(self, req: Req, prefilling: Iterable[Req]) -> bool:
        """Would `req` compute WAIT_FOR_SHARED_TOKENS or more prompt tokens that a request in
        this batch, or one whose prefill is still in flight, computes too? Then it waits a
        step or two and finds them in the prefix cache: a burst of prompts with one long
        system prompt computes it once, not once per prompt."""
        cache = self.kv.cache
        if cache is None or req.kv.pages:
            return False
        ids, ps = req.fill_ids, self.kv.page_size
        usable = (len(ids) - 1) // ps * ps
        shared = max((_common_pages(ids, other.fill_ids, ps, usable)
                      for other in (*self.batch.reqs, *prefilling)
                      if other.cache_salt == req.cache_salt), default=0)
        if shared < WAIT_FOR_SHARED_TOKENS:
            return False
        cached = len(cache.match(ids[:shared], req.cache_salt)[0]) * ps
        return shared - cached >= WAIT_FOR_SHARED_TOKENS

    def _fits(self, req: Req) -> bool:
        remaining = len(req.fill_ids) - req.kv.length
        n = min(remaining, self.budget)
        pages = self.kv.pages_needed(req, req.kv.length + n)
        reserve = 0
        if n == remaining:
            reserve = self.kv.allocator.pages_for(decode_reserve_tokens([req], self.ratio))
        # live: locking a cached prefix takes its pages off what eviction could free
        free = self.kv.available_pages - self.reserved_pages - self.claimed_pages
        alone = self.nothing_running and self.batch.is_empty()
        # Alone, a request may ignore the decode estimate: nothing else could make room.
        if pages > free or (pages + reserve > free and not alone):
            return False
        self.claimed_pages += pages + reserve
        return True

    def _take(self, req: Req) -> bool:
        if req.kv.row is None:
            self.rows_claimed += 1
        remaining = len(req.fill_ids) - req.kv.length
        n = min(remaining, self.budget)
        is_last = n == remaining
        self.budget -= n
        self.batch.reqs.append(req)
        self.batch.extend_lens.append(n)
        self.batch.is_last_chunk.append(is_last)
        if not is_last:
            self.chunked = req
        return is_last


def _common_pages(a: list[int], b: list[int], page_size: int, limit: int) -> int:
    """Tokens in the full pages `a` and `b` start with alike (at most `limit`)."""
    n = 0
    while n + page_size <= limit and a[n:n + page_size] == b[n:n + page_size]:
        n += page_size
    return n
