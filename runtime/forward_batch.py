"""What one forward pass consumes and produces.

The scheduler builds a `ForwardBatch` from its `ScheduleBatch`; the model runner turns it into a
`ForwardOutput`. Only tensors and plain lists cross this line, so the runner never sees a Req.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

ForwardMode = Literal["extend", "decode"]


@dataclass
class SamplingBatchInfo:
    """Per-request sampling parameters as [B] tensors (CPU), plus flags for fast paths."""

    temperatures: torch.Tensor  # [B] float32; 0 means greedy
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64; vocab size when unset
    min_ps: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    # Position the sampled token will take; with the seed it fixes the random draw, so the same
    # seed gives the same text whatever the batch, chunking or retraction.
    sample_positions: torch.Tensor  # [B] int64
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    # Penalties (None when no request in the batch uses them).
    repetition_penalties: torch.Tensor | None = None  # [B] float32
    frequency_penalties: torch.Tensor | None = None  # [B] float32
    presence_penalties: torch.Tensor | None = None  # [B] float32
    # Requests whose penalty state starts here (their sampling extend): row -> tokens seen so far.
    penalty_resets: list[tuple[int, list[int], list[int]]] = field(default_factory=list)
    # OpenAI logit_bias (None when no request in the batch has one): [N] row indices, [N] token
    # ids and [N] float32 biases, added to the row's logits before sampling.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Identity of each row for backends that key on it (token oracle, canary; seed 002), set only
    # when the sampler asks for it: [B] int64 rid hashes, and rooms with -1 for none.
    rids_int: torch.Tensor | None = None
    bootstrap_room_ids_int: torch.Tensor | None = None

    @property
    def need_penalties(self) -> bool:
        return self.repetition_penalties is not None


@dataclass
class ForwardBatch:
    mode: ForwardMode
    # [T] int64 tokens to run. In overlap mode a decode batch may hold -future_index placeholders,
    # swapped for real tokens by FutureMap.resolve_future right before the forward.
    input_ids: torch.Tensor
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64: KV slot each new token writes
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: list[int]  # [B] length of each request after this forward
    extend_lens: list[int]  # [B] new tokens per request (1 each in decode)
    sampling: SamplingBatchInfo
    return_logprob: bool = False
    top_logprobs_num: int = 0  # max over the batch; 0: none

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def prefix_lens(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens, self.extend_lens, strict=True)]


@dataclass
class ForwardOutput:
    next_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32: logprob of the sampled token
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None  # ([B, k] values, [B, k] ids)
    # Per-token metadata from the sampler backend: key -> one value per request row.
    customized_info: dict[str, list[Any]] | None = None
