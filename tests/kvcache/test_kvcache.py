"""Page allocator, req->token table and the manager that ties them together."""

from __future__ import annotations

import pytest

from runtime.kvcache.allocator import OutOfPages, PageAllocator
from runtime.kvcache.manager import KVCacheManager
from runtime.kvcache.req_to_token import ReqToTokenPool
from runtime.sampling_params import SamplingParams
from runtime.scheduler.req import Req


def test_allocator_alloc_free_and_double_free() -> None:
    a = PageAllocator(num_pages=4, page_size=8)
    pages = a.alloc(3)
    assert len(set(pages)) == 3 and a.available_pages == 1 and a.available_tokens == 8
    with pytest.raises(OutOfPages):
        a.alloc(2)
    a.free(pages[:1])
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free(pages[:1])
    a.free(pages[1:])
    assert a.is_all_free()
    assert a.pages_for(17) == 3 and a.pages_for(16) == 2 and a.pages_for(0) == 0


def test_manager_maps_positions_to_page_slots_and_releases() -> None:
    kv = KVCacheManager(PageAllocator(8, 4), ReqToTokenPool(2, 64))
    req = Req("r", [1] * 6, SamplingParams())
    slots = kv.grow(req, 6).tolist()
    assert len(req.kv.pages) == 2 and req.kv.length == 6
    p0, p1 = req.kv.pages
    assert slots == [p0 * 4, p0 * 4 + 1, p0 * 4 + 2, p0 * 4 + 3, p1 * 4, p1 * 4 + 1]
    more = kv.grow_one_each([req, req]).tolist()  # positions 6 and 7, still page p1
    assert more == [p1 * 4 + 2, p1 * 4 + 3] and len(req.kv.pages) == 2
    assert kv.grow_one_each([req]).tolist() == [req.kv.pages[2] * 4]  # position 8: a new page
    assert req.kv.row is not None
    row = kv.req_to_token.table[req.kv.row, :9].tolist()
    assert row == slots + more + [req.kv.pages[2] * 4]
    kv.release(req)
    kv.release(req)  # idempotent
    assert kv.is_all_free() and req.kv.pages == [] and req.kv.row is None


def test_req_to_token_pool_exhaustion_is_clear() -> None:
    pool = ReqToTokenPool(1, 8)
    idx = pool.alloc()
    with pytest.raises(RuntimeError, match="max-running-requests"):
        pool.alloc()
    pool.free(idx)
    with pytest.raises(RuntimeError, match="twice"):
        pool.free(idx)
