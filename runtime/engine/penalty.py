"""Repetition / frequency / presence penalties with per-request state.

State lives in rows indexed by the request's req_pool_idx, so filtering or merging batches needs
no bookkeeping here, and only the forward thread ever touches it (no race with the scheduler in
overlap mode). Decode steps accumulate from the batch's `input_ids`: the tokens sampled last step.
"""

from __future__ import annotations

import torch

from runtime.forward_batch import PenaltyResets, SamplingBatchInfo


class PenaltyState:
    def __init__(self, max_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.max_reqs = max_reqs
        self.vocab_size = vocab_size
        self.device = device
        self.seen: torch.Tensor | None = None  # [max_reqs, V] bool: prompt + output tokens
        self.counts: torch.Tensor | None = None  # [max_reqs, V] int32: output tokens

    def _ensure(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.seen is None or self.counts is None:
            shape = (self.max_reqs, self.vocab_size)
            self.seen = torch.zeros(shape, dtype=torch.bool, device=self.device)
            self.counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        return self.seen, self.counts

    def reset(self, resets: PenaltyResets) -> None:
        """Start rows afresh from the tokens each has seen so far (see PenaltyResets)."""
        seen, counts = self._ensure()
        rows, seen_rows, seen_tokens, count_rows, count_tokens = resets
        # NOTE: every write takes its value as a device tensor or a fill: `t[rows] = 0` would
        # copy the 0 from host memory on CUDA, a wait on every step.
        seen.index_fill_(0, rows, False)
        counts.index_fill_(0, rows, 0)
        self._count(seen_rows, seen_tokens, count_rows, count_tokens)

    def accumulate(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each row's newest output token (decode input_ids, already resolved)."""
        self._count(rows, tokens, rows, tokens)

    def _count(self, seen_rows: torch.Tensor, seen_tokens: torch.Tensor, count_rows: torch.Tensor,
               count_tokens: torch.Tensor) -> None:
        """Mark (row, token) pairs seen; add one per (row, token) pair to the counts."""
        seen, counts = self._ensure()
        seen.index_put_((seen_rows, seen_tokens), torch.ones_like(seen_rows, dtype=torch.bool))
        ones = torch.ones_like(count_rows, dtype=torch.int32)
        counts.index_put_((count_rows, count_tokens), ones, accumulate=True)

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        assert info.repetition_penalties is not None
        assert info.frequency_penalties is not None and info.presence_penalties is not None
        seen, counts = self._ensure()
        seen_rows, count_rows = seen[rows], counts[rows].float()  # [B, V]
        rep = info.repetition_penalties.unsqueeze(1)
        # HF semantics: divide positive logits, multiply negative ones, for every token seen.
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen_rows, penalized, logits)
        # OpenAI semantics on output tokens only.
        logits = logits - info.frequency_penalties.unsqueeze(1) * count_rows
        return logits - info.presence_penalties.unsqueeze(1) * (count_rows > 0).float()
