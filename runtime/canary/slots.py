"""SlotTags: the engine's side of the KV canary, a side tensor next to the KV pool.

    tags [num_slots] int64: the token chain (runtime/canary/chain.py) of the KV each slot holds
    sums [num_slots] int64: the slot's byte checksum (kvsum.py), with --kv-canary-bytes only

Every forward writes the tags of the slots it writes, computed from what it actually ran: the
tag the request's previous position's slot carries (read through the req->token table, as
attention reads it) chained with the batch's input tokens at their positions. A check step then
compares, for the positions the scheduler asks about, the tag in the slot the table names with
the tag the scheduler expects from the request's own tokens (ForwardBatch.canary), and the
slot's bytes with its checksum. Decode steps whose sampler is the token oracle also check that
each input token is the oracle's for its position. Violations come back per row and kind
(ForwardOutput.canary_violations); the scheduler decides what they mean.

Under tensor parallelism every rank keeps its own SlotTags over its own pool (its KV heads):
the tags alike on every rank (the same forwards, the same table), the sums its partial ones
(kvsum.py); each rank checks its own, and the guard joins the ranks' violations.
"""

from __future__ import annotations

import torch

from runtime.canary.chain import segmented_chain
from runtime.canary.kvsum import BytesMode, HeadSplit, SlotSums
from runtime.canary.oracle import identities, oracle_tokens
from runtime.forward_batch import ForwardBatch
from runtime.kvcache.pool import KVPool

VIOLATION_KINDS = ("tag", "bytes", "token")  # columns of canary_violations


class SlotTags:
    def __init__(self, num_slots: int, table: torch.Tensor, pool: KVPool | None = None,
                 bytes_mode: BytesMode = "none", oracle_vocab: int | None = None,
                 split: HeadSplit | None = None) -> None:
        """`table`: the req->token table attention reads; `pool`: for byte checksums, of the
        KV heads `split` says (None: all); `oracle_vocab`: the vocabulary of a token-oracle
        sampler (None: no token check)."""
        self.table = table
        self.tags = torch.zeros(num_slots, dtype=torch.int64, device=table.device)
        self.sums: SlotSums | None = None
        self.slot_sums: torch.Tensor | None = None
        if bytes_mode != "none":
            assert pool is not None, "byte checksums need the KV pool"
            self.sums = SlotSums(pool, bytes_mode, split)
            self.slot_sums = torch.zeros_like(self.tags)
        self.oracle_vocab = oracle_vocab

    def write(self, batch: ForwardBatch) -> None:
        """After the forward wrote its KV: tag (and checksum) the slots it wrote."""
        starts = batch.seq_lens_t - batch.extend_lens_t  # [B] first new position
        rows = batch.req_pool_indices
        prev = self.tags[self.table[rows, (starts - 1).clamp(min=0)]]
        prev = torch.where(starts > 0, prev, torch.zeros_like(prev))  # [B]
        self.tags[batch.out_cache_loc] = segmented_chain(prev, batch.input_ids, batch.positions,
                                                         batch.extend_lens_t)
        if self.sums is not None and self.slot_sums is not None:
            self.slot_sums[batch.out_cache_loc] = self.sums.of(batch.out_cache_loc)

    def check(self, batch: ForwardBatch) -> torch.Tensor:
        """[B, len(VIOLATION_KINDS)] int64: violations per row and kind."""
        assert batch.canary is not None
        rows, positions, expected, _ = batch.canary
        found = torch.zeros((batch.batch_size, len(VIOLATION_KINDS)), dtype=torch.int64,
                            device=self.tags.device)
        if len(rows):
            slots = self.table[batch.req_pool_indices[rows], positions]  # [N]
            found[:, 0].index_add_(0, rows, (self.tags[slots] != expected).long())
            if self.sums is not None and self.slot_sums is not None:
                bad = self.sums.of(slots) != self.slot_sums[slots]
                found[:, 1].index_add_(0, rows, bad.long())
        info = batch.sampling
        if (self.oracle_vocab is not None and batch.mode == "decode" and info.rids_int is not None
                and info.bootstrap_room_ids_int is not None):
            ids = identities(info.rids_int, info.bootstrap_room_ids_int)
            want = oracle_tokens(ids, batch.positions, self.oracle_vocab)
            found[:, 2] = (batch.input_ids != want).long()
        return found
