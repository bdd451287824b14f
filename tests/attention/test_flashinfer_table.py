"""The page table the flashinfer backend hands its wrappers, built from our own bookkeeping:
indptr and last-page lengths from the host's sequence lengths, page indices gathered on the
device from the req->token table. Checked here against each request's own page list (the
wrappers themselves need CUDA and flashinfer: tests/gpu)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from runtime.attention.flashinfer_backend import page_counts, page_indices
from runtime.kvcache.allocator import PageAllocator
from runtime.kvcache.manager import KVCacheManager, KVSlots
from runtime.kvcache.req_to_token import ReqToTokenPool


@dataclass
class Holder:
    kv: KVSlots = field(default_factory=KVSlots)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_table_lists_each_requests_pages_in_order(page_size: int) -> None:
    rng = random.Random(page_size)
    allocator = PageAllocator(800, page_size)
    pages = allocator.alloc(800)
    rng.shuffle(pages)
    allocator.free(pages)  # hand pages out in a scattered order
    kv = KVCacheManager(allocator, ReqToTokenPool(8, 512))
    holders = [Holder() for _ in range(6)]
    for _ in range(3):  # grow in turns, so requests' pages interleave
        for h in holders:
            kv.grow(h, h.kv.length + rng.randint(1, 40))
    order = [4, 0, 5, 2]  # a batch is any subset, in any order
    seq_lens = [holders[i].kv.length for i in order]
    indptr, last, total = page_counts(seq_lens, page_size)
    req_idx = torch.tensor([holders[i].kv.row for i in order])
    indices = page_indices(kv.req_to_token.table, req_idx, torch.tensor(seq_lens), page_size, total)
    assert indices.dtype == indptr.dtype == last.dtype == torch.int32
    assert indices.tolist() == [p for i in order for p in holders[i].kv.pages]
    assert indptr.tolist() == [0, *torch.tensor([len(holders[i].kv.pages) for i in order]).cumsum(0).tolist()]
    assert all(1 <= n <= page_size for n in last.tolist())
    assert [(p - 1) * page_size + n for p, n in zip(indptr.diff().tolist(), last.tolist(), strict=True)] == seq_lens
