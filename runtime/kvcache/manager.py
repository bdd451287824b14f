"""KVCacheManager: gives requests KV slots page by page and takes them back.

The scheduler's only entry into KV bookkeeping. It writes the req->token table so the attention
backend can find every position's slot (on a GPU the next forward carries the writes: see
ReqToTokenPool); it never touches the KV buffers themselves. Everything here is host work.

With a prefix cache (runtime/kvcache/radix.py) a request starts from the longest cached prefix
of its tokens (`adopt_prefix`), and what it computed goes into the cache when it lets go
(`release`) instead of back to the allocator. Pages the cache holds unlocked count as available:
they are evicted, least recently used first, when the allocator runs short.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from runtime.kvcache.allocator import PageAllocator
from runtime.kvcache.radix import RadixCache
from runtime.kvcache.req_to_token import ReqToTokenPool


@dataclass
class KVSlots:
    """One request's hold on the KV pool, which only the manager changes: its req->token table
    row, its pages, how many positions have (or are getting) a slot, how many of those a
    finished forward wrote (cacheable), and the prefix-cache node it reads from (locked)."""

    row: int | None = None
    pages: list[int] = field(default_factory=list)
    length: int = 0
    computed: int = 0
    node: Any = None

    def give_up(self) -> KVSlots:
        """Hand this hold to another owner (a moved request) and keep nothing."""
        held = KVSlots(self.row, self.pages, self.length, self.computed, self.node)
        self.row, self.pages, self.length, self.computed, self.node = None, [], 0, 0, None
        return held


class KVHolder(Protocol):
    """What the manager needs of a request (Req satisfies it)."""

    kv: KVSlots
    cache_salt: str | None  # the prefix cache's namespace (runtime/kvcache/radix.py)

    @property
    def fill_ids(self) -> list[int]: ...


class KVCacheManager:
    def __init__(self, allocator: PageAllocator, req_to_token: ReqToTokenPool,
                 cache: RadixCache | None = None) -> None:
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.page_size = allocator.page_size
        self.cache = cache

    @property
    def available_pages(self) -> int:
        """Free pages plus those the cache would give up."""
        evictable = self.cache.evictable_pages if self.cache is not None else 0
        return self.allocator.available_pages + evictable

    def used_pages(self) -> int:
        """Pages requests hold (cached pages nobody reads are not counted)."""
        return self.allocator.num_pages - self.available_pages

    def _alloc(self, n: int) -> list[int]:
        self._make_room(n)
        return self.allocator.alloc(n)

    def _make_room(self, n: int) -> None:
        """Evict cached pages until `n` are free (one pass over the tree, however many)."""
        short = n - self.allocator.available_pages
        if short > 0 and self.cache is not None:
            self.allocator.free(self.cache.evict(short))

    def adopt_prefix(self, req: KVHolder) -> int:
        """A request about to be prefilled from scratch starts from the longest cached prefix
        of its tokens (full pages, leaving at least its last token to compute: that forward
        samples its next one). Locks it; returns the number of tokens reused."""
        if self.cache is None or req.kv.pages:
            return 0
        tokens = req.fill_ids
        usable = (len(tokens) - 1) // self.page_size * self.page_size
        pages, node = self.cache.match(tokens[:usable], req.cache_salt)
        if not pages:
            return 0
        self.cache.lock(node)
        req.kv.node = node
        if req.kv.row is None:
            req.kv.row = self.req_to_token.alloc()
        n = len(pages) * self.page_size
        pos = torch.arange(n, dtype=torch.int64)
        slots = torch.tensor(pages, dtype=torch.int64).repeat_interleave(self.page_size) * \
            self.page_size + pos % self.page_size
        self.req_to_token.write(torch.full_like(pos, req.kv.row), pos, slots)
        req.kv.pages = list(pages)
        req.kv.length = req.kv.computed = n
        return n

    def count_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """An admitted request looked up `query_tokens` and found `hit_tokens` cached."""
        if self.cache is not None:
            self.cache.stats.query_tokens += query_tokens
            self.cache.stats.hit_tokens += hit_tokens

    def cache_progress(self, req: KVHolder) -> None:
        """A request still running (a long chunked prefill) offers its computed full pages to
        the cache now, so others can reuse them before it ends. It keeps reading them, so this
        stops before any page the cache already holds elsewhere (that one goes at `release`)."""
        if self.cache is None:
            return
        full = req.kv.computed // self.page_size
        node, _ = self.cache.insert(req.fill_ids[:full * self.page_size], req.kv.pages[:full],
                                    salt=req.cache_salt, stop_at_duplicate=True)
        if node is req.kv.node or node.parent is None:  # (None: nothing new went in)
            return
        self.cache.lock(node)
        if req.kv.node is not None:
            self.cache.unlock(req.kv.node)
        req.kv.node = node

    def pages_needed(self, req: KVHolder, new_len: int) -> int:
        return max(0, self.allocator.pages_for(new_len) - len(req.kv.pages))

    def grow(self, req: KVHolder, new_len: int) -> torch.Tensor:
        """Give `req` slots for positions [req.kv.length, new_len); return those slots ([n] int64)."""
        if req.kv.row is None:
            req.kv.row = self.req_to_token.alloc()
        need = self.pages_needed(req, new_len)
        if need:
            req.kv.pages.extend(self._alloc(need))
        start = req.kv.length
        pos = torch.arange(start, new_len, dtype=torch.int64)
        pages = torch.tensor(req.kv.pages, dtype=torch.int64)
        slots = pages[pos // self.page_size] * self.page_size + pos % self.page_size
        self.req_to_token.write(torch.full_like(pos, req.kv.row), pos, slots)
        req.kv.length = new_len
        return slots

    def grow_one_each(self, reqs: list[KVHolder]) -> torch.Tensor:
        """Decode: one more slot for every request, in one table write. Returns [B] slots."""
        ps = self.page_size
        self._make_room(sum(1 for r in reqs if r.kv.length // ps >= len(r.kv.pages)))
        slots, rows, cols = [], [], []
        for r in reqs:
            pos = r.kv.length
            if pos // ps >= len(r.kv.pages):
                r.kv.pages.extend(self.allocator.alloc(1))
            slots.append(r.kv.pages[pos // ps] * ps + pos % ps)
            assert r.kv.row is not None
            rows.append(r.kv.row)
            cols.append(pos)
            r.kv.length = pos + 1
        out = torch.tensor(slots, dtype=torch.int64)
        self.req_to_token.write(torch.tensor(rows), torch.tensor(cols), out)
        return out

    def release(self, req: KVHolder) -> None:
        """Give back every page and the table row `req` holds. Idempotent. With a cache, the
        full pages of what its forwards computed go into the cache (those it already held
        elsewhere are freed) and the lock is dropped; the rest is freed."""
        pages, req.kv.pages = req.kv.pages, []
        if self.cache is not None and pages:
            full = min(req.kv.computed // self.page_size, len(pages))
            _, dups = self.cache.insert(req.fill_ids[:full * self.page_size], pages[:full],
                                        salt=req.cache_salt)
            if req.kv.node is not None:
                self.cache.unlock(req.kv.node)
            pages = dups + pages[full:]
        req.kv.node = None
        if pages:
            self.allocator.free(pages)
        if req.kv.row is not None:
            self.req_to_token.free(req.kv.row)
            req.kv.row = None
        req.kv.length = req.kv.computed = 0

    def discard(self, req: KVHolder) -> None:
        """Like `release`, but what the request computed is not offered to the cache: its KV
        is suspect (the KV canary caught it). Pages the cache held already stay there."""
        held = 0
        node = req.kv.node
        while node is not None and node.parent is not None:
            held, node = held + 1, node.parent
        req.kv.computed = held * self.page_size  # release re-inserts those: nothing new
        self.release(req)

    def flush_cache(self) -> int:
        """Free every page the cache holds unlocked; returns how many."""
        if self.cache is None:
            return 0
        freed = self.cache.flush()
        self.allocator.free(freed)
        return len(freed)

    def is_all_free(self) -> bool:
        """No request holds a page or a table row: every page is free or cached unlocked."""
        return (self.available_pages == self.allocator.num_pages
                and self.req_to_token.is_all_free())
