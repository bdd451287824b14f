"""KVCacheManager: gives requests KV slots page by page and takes them back.

The scheduler's only entry into KV bookkeeping. It writes the req->token table so the attention
backend can find every position's slot (on a GPU the next forward carries the writes: see
ReqToTokenPool); it never touches the KV buffers themselves. Everything here is host work.
"""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.kvcache.allocator import PageAllocator
from runtime.kvcache.req_to_token import ReqToTokenPool


class KVHolder(Protocol):
    """What the manager needs of a request (Req satisfies it)."""

    req_pool_idx: int | None
    kv_pages: list[int]
    kv_len: int


class KVCacheManager:
    def __init__(self, allocator: PageAllocator, req_to_token: ReqToTokenPool) -> None:
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.page_size = allocator.page_size

    def pages_needed(self, req: KVHolder, new_len: int) -> int:
        return max(0, self.allocator.pages_for(new_len) - len(req.kv_pages))

    def grow(self, req: KVHolder, new_len: int) -> torch.Tensor:
        """Give `req` slots for positions [req.kv_len, new_len); return those slots ([n] int64)."""
        if req.req_pool_idx is None:
            req.req_pool_idx = self.req_to_token.alloc()
        need = self.pages_needed(req, new_len)
        if need:
            req.kv_pages.extend(self.allocator.alloc(need))
        start = req.kv_len
        pos = torch.arange(start, new_len, dtype=torch.int64)
        pages = torch.tensor(req.kv_pages, dtype=torch.int64)
        slots = pages[pos // self.page_size] * self.page_size + pos % self.page_size
        self.req_to_token.write(torch.full_like(pos, req.req_pool_idx), pos, slots)
        req.kv_len = new_len
        return slots

    def grow_one_each(self, reqs: list[KVHolder]) -> torch.Tensor:
        """Decode: one more slot for every request, in one table write. Returns [B] slots."""
        ps = self.page_size
        slots, rows, cols = [], [], []
        for r in reqs:
            pos = r.kv_len
            if pos // ps >= len(r.kv_pages):
                r.kv_pages.extend(self.allocator.alloc(1))
            slots.append(r.kv_pages[pos // ps] * ps + pos % ps)
            assert r.req_pool_idx is not None
            rows.append(r.req_pool_idx)
            cols.append(pos)
            r.kv_len = pos + 1
        out = torch.tensor(slots, dtype=torch.int64)
        self.req_to_token.write(torch.tensor(rows), torch.tensor(cols), out)
        return out

    def release(self, req: KVHolder) -> None:
        """Free every page and the table row `req` holds. Idempotent."""
        if req.kv_pages:
            self.allocator.free(req.kv_pages)
            req.kv_pages = []
        if req.req_pool_idx is not None:
            self.req_to_token.free(req.req_pool_idx)
            req.req_pool_idx = None
        req.kv_len = 0

    def is_all_free(self) -> bool:
        return self.allocator.is_all_free() and self.req_to_token.is_all_free()
