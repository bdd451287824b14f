"""A model-free runner: each next token is a hash of the request's whole cached sequence.

It reads the sequence back through the req->token table and a token-per-slot "KV pool", so a
request whose KV is misplaced, stale, or mixed with another's gets different tokens than
`expected_outputs` predicts from the prompt alone.
"""

from __future__ import annotations

import torch

from runtime.canary.guard import build_guard
from runtime.config import CanaryConfig
from runtime.forward_batch import ForwardBatch, ForwardOutput
from runtime.kvcache.allocator import PageAllocator
from runtime.kvcache.manager import KVCacheManager
from runtime.kvcache.radix import RadixCache
from runtime.kvcache.req_to_token import ReqToTokenPool

VOCAB = 1000


def next_token(seq: list[int]) -> int:
    h = 7
    for t in seq:
        h = (h * 1_000_003 + t) % 2_147_483_647
    return h % VOCAB


def expected_outputs(prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        tok = next_token(seq)
        seq.append(tok)
        out.append(tok)
        if tok == eos:
            break
    return out


class FakeRunner:
    def __init__(
        self, num_pages: int = 64, page_size: int = 4, max_reqs: int = 16, context_len: int = 256,
        prefix_cache: bool = False, canary: CanaryConfig | None = None,
    ) -> None:
        self.kv = KVCacheManager(
            PageAllocator(num_pages, page_size), ReqToTokenPool(max_reqs, context_len),
            RadixCache(page_size) if prefix_cache else None,
        )
        self.device = torch.device("cpu")
        self.context_len = context_len
        self.vocab_size = VOCAB
        self.eos_token_ids: tuple[int, ...] = ()
        self.needs_request_ids = False
        self.slot_tokens = torch.full((num_pages * page_size,), -1, dtype=torch.int64)
        self.batches: list[ForwardBatch] = []
        # the real KV canary over the token-per-slot pool (no byte checksums: no KV bytes)
        self.canary = build_guard(canary, self.kv.req_to_token.table, None, num_pages * page_size,
                                  VOCAB, oracle=False)

    def forward_batch(self, batch: ForwardBatch) -> ForwardOutput:
        assert bool((batch.input_ids >= 0).all()), "unresolved future placeholder reached forward"
        self.batches.append(batch)
        self.slot_tokens[batch.out_cache_loc] = batch.input_ids
        table = self.kv.req_to_token.table
        nxt = []
        for row, seq_len in zip(batch.req_pool_indices.tolist(), batch.seq_lens, strict=True):
            nxt.append(next_token(self.slot_tokens[table[row, :seq_len]].tolist()))
        out = ForwardOutput(torch.tensor(nxt, dtype=torch.int64))
        if self.canary is not None:
            self.canary.after_forward(batch, out)
        return out
