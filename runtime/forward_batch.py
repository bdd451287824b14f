"""What one forward pass consumes and produces.

The scheduler builds a `ForwardBatch` from its `ScheduleBatch`; the model runner turns it into a
`ForwardOutput`. Only tensors and plain lists cross this line, so the runner never sees a Req.
Batches are built on the host; `ForwardBatch.to(device)` moves all their tensors in one copy, and
a forward's results come back through `ForwardOutput.on_host()` (runtime/device.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from runtime.device import HostCopy, is_on, to_device

ForwardMode = Literal["extend", "decode"]

# Penalty rows to start afresh: [R] rows; their prompt + output tokens as [N] (row, token)
# pairs; their output tokens (repeats counted) as [M] (row, token) pairs. All int64.
PenaltyResets = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# KV canary (runtime/canary/): [N] batch rows, [N] positions and [N] expected tags of the slots
# to check (N = 0 on a step that does not check), and [B] bool: rows fault injection may hit.
CanaryInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class SamplingBatchInfo:
    """Per-request sampling parameters as [B] tensors (built on the host, staged to the forward's
    device with the batch), plus flags and bounds for fast paths, known without a device sync."""

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
    max_top_k: int  # max(top_ks), known on the host
    # Penalties (None when no request in the batch uses them).
    repetition_penalties: torch.Tensor | None = None  # [B] float32
    frequency_penalties: torch.Tensor | None = None  # [B] float32
    presence_penalties: torch.Tensor | None = None  # [B] float32
    # Requests whose penalty state starts here (their sampling extend, or a prebuilt request's
    # first decode step), with the tokens each has seen so far (None when there are none).
    penalty_resets: PenaltyResets | None = None
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


def _tensors(obj: Any, names: tuple[str, ...]) -> list[torch.Tensor]:
    """The tensors in `obj`'s fields `names`, in order (a tuple field gives each of its own)."""
    flat: list[torch.Tensor] = []
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, tuple):
            flat.extend(value)
        elif value is not None:
            flat.append(value)
    return flat


def _replaced(obj: Any, names: tuple[str, ...], tensors: Iterator[torch.Tensor]) -> Any:
    """`obj` with the tensors of fields `names` replaced, in `_tensors` order, by `tensors`."""
    changes: dict[str, Any] = {}
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, tuple):
            changes[name] = tuple(next(tensors) for _ in value)
        elif value is not None:
            changes[name] = next(tensors)
    return dataclasses.replace(obj, **changes)


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
    seq_lens_t: torch.Tensor  # [B] int64: seq_lens, for kernels
    extend_lens_t: torch.Tensor  # [B] int64: extend_lens, for kernels
    sampling: SamplingBatchInfo
    return_logprob: bool = False
    top_logprobs_num: int = 0  # max over the batch; 0: none
    # req->token table entries to write on the device before this forward ([N] rows, [N]
    # positions, [N] slots); None where the scheduler writes the table itself (a host table).
    table_writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    canary: CanaryInputs | None = None  # None: the KV canary is off

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def prefix_lens(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens, self.extend_lens, strict=True)]

    def to(self, device: torch.device) -> ForwardBatch:
        """This batch with every tensor on `device`, moved in one copy (runtime/device.py).
        The scheduler builds batches on the host; the identity when `device` is the CPU or the
        batch is there already."""
        if device.type == "cpu" or is_on(self.positions.device, device):
            return self
        flat = _tensors(self, BATCH_TENSORS) + _tensors(self.sampling, SAMPLING_TENSORS)
        moved = iter(to_device(flat, device))
        batch: ForwardBatch = _replaced(self, BATCH_TENSORS, moved)
        batch.sampling = _replaced(self.sampling, SAMPLING_TENSORS, moved)
        return batch


@dataclass
class ForwardOutput:
    next_token_ids: torch.Tensor  # [B] int64, on the forward's device
    logprobs: torch.Tensor | None = None  # [B] float32: logprob of the sampled token
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None  # ([B, k] values, [B, k] ids)
    # Per-token metadata from the sampler backend: key -> one value per request row.
    customized_info: dict[str, list[Any]] | None = None
    # The tensors above on their way to the host, started by the runner right after sampling
    # (None: they are on the host already). Read them through on_host().
    host_copy: HostCopy | None = None
    # KV canary: [B, kinds] int64 violations per row (runtime/canary/slots.py; None: off), and
    # the faults injected into this forward, as (row, kind) (runtime/canary/perturb.py).
    canary_violations: torch.Tensor | None = None
    injections: list[tuple[int, str]] | None = None

    def start_host_copy(self) -> ForwardOutput:
        """Start copying the results to the host (one packed copy; nothing on the CPU)."""
        self.host_copy = HostCopy(_tensors(self, RESULT_TENSORS))
        return self

    def on_host(self) -> ForwardOutput:
        """The results on the host; waits for this forward's copy only."""
        if self.host_copy is None or self.next_token_ids.device.type == "cpu":
            return self
        out: ForwardOutput = _replaced(self, RESULT_TENSORS, iter(self.host_copy.wait()))
        out.host_copy = None
        return out


# The fields that hold tensors, which travel between host and device (tests/test_forward_batch.py
# checks that every tensor-typed field is named here).
SAMPLING_TENSORS = (
    "temperatures", "top_ps", "top_ks", "min_ps", "seeds", "sample_positions",
    "repetition_penalties", "frequency_penalties", "presence_penalties", "penalty_resets", "logit_bias",
    "rids_int", "bootstrap_room_ids_int",
)  # fmt: skip
BATCH_TENSORS = (
    "input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens_t", "extend_lens_t",
    "table_writes", "canary",
)  # fmt: skip
RESULT_TENSORS = ("next_token_ids", "logprobs", "top_logprobs", "canary_violations")
