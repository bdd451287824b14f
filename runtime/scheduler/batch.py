"""ScheduleBatch: the requests of one forward and the tokens that bridge iterations.

`input_ids` is the only cross-iteration token bridge (seed 003): when a forward ends it holds the
batch's next tokens — real ids, or in overlap mode `-future_index` placeholders that
FutureMap.resolve_future swaps for real ids right before the next forward. There is no
`output_ids` on the batch. `filter_batch` and `merge_batch` keep it aligned with `reqs`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from runtime.canary.identity import rids_to_tensor, rooms_to_tensor
from runtime.forward_batch import ForwardBatch, ForwardMode, PenaltyResets, SamplingBatchInfo
from runtime.kvcache.manager import KVCacheManager
from runtime.sampling_params import SamplingParams
from runtime.scheduler.req import Req


@dataclass
class ScheduleBatch:
    reqs: list[Req] = field(default_factory=list)
    mode: ForwardMode = "decode"
    input_ids: torch.Tensor | None = None  # [B] after a forward (see module docstring)
    # Extend only: new tokens per request, and whether this chunk completes the prompt.
    extend_lens: list[int] = field(default_factory=list)
    is_last_chunk: list[bool] = field(default_factory=list)
    # decode: the rows' constant part, built once while the rows stay the same (a running batch
    # keeps it step after step; filter_batch and merge_batch drop it)
    rows_kept: Rows | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    # ---- shape changes that keep input_ids aligned -------------------------------------------
    def filter_batch(self, keep: list[int]) -> None:
        """Keep only rows `keep` (indices into reqs), in that order."""
        if keep == list(range(len(self.reqs))):
            return
        self.reqs = [self.reqs[i] for i in keep]
        self.rows_kept = None
        if not self.reqs:
            self.input_ids = None
        elif self.input_ids is not None:
            self.input_ids = self.input_ids[torch.tensor(keep, dtype=torch.int64)]

    def merge_batch(self, other: ScheduleBatch) -> None:
        """Append `other`'s requests. A side with requests must carry its input_ids when the
        other side does: merging would otherwise silently misalign tokens and requests."""
        if other.is_empty():
            return
        if self.is_empty():
            self.input_ids = other.input_ids
        elif self.input_ids is None and other.input_ids is None:
            pass
        elif self.input_ids is None or other.input_ids is None:
            side = "left" if self.input_ids is None else "right"
            raise ValueError(f"merge_batch: {side} batch has requests but no input_ids")
        else:
            self.input_ids = torch.cat([self.input_ids, other.input_ids])
        self.reqs = self.reqs + other.reqs
        self.rows_kept = None

    # ---- building forwards --------------------------------------------------------------------
    def prepare_for_extend(self, kv: KVCacheManager, with_ids: bool = False) -> ForwardBatch:
        """Give each request slots for its chunk and build the flat token batch (`with_ids`: its
        sampling info carries each request's identity, for samplers keyed on it, seed 002)."""
        self.mode = "extend"
        tokens: list[int] = []
        positions, slots, resets = [], [], []
        for req, n in zip(self.reqs, self.extend_lens, strict=True):
            start = req.kv.length  # > 0 for a later chunk, or a prefix found in the cache
            req.is_retracted = False  # re-admitted: the forwards it missed were all processed
            tokens.extend(req.fill_ids[start : start + n])
            positions.append(torch.arange(start, start + n, dtype=torch.int64))
            slots.append(kv.grow(req, start + n))
        self.input_ids = torch.tensor(tokens, dtype=torch.int64)
        for req, last in zip(self.reqs, self.is_last_chunk, strict=True):
            if last and req.sampling_params.uses_penalties:
                assert req.kv.row is not None
                resets.append((req.kv.row, *req.penalty_history(list(req.output_ids))))
        return self._forward_batch(kv, torch.cat(positions), torch.cat(slots), self.extend_lens,
                                   resets, with_ids)

    def prepare_for_decode(self, kv: KVCacheManager, with_ids: bool = False) -> ForwardBatch:
        """One new token per request: the one input_ids carries from the last forward."""
        self.mode = "decode"
        if self.input_ids is None or len(self.input_ids) != len(self.reqs):
            raise RuntimeError("decode batch without one input token per request")
        positions = torch.tensor([r.kv.length for r in self.reqs], dtype=torch.int64)
        slots = kv.grow_one_each(self.reqs)  # type: ignore[arg-type]
        resets = []
        for req in self.reqs:
            if req.needs_penalty_reset:  # prebuilt (decode role): this step's input is its 1st token
                assert req.kv.row is not None
                resets.append((req.kv.row, *req.penalty_history(req.output_ids[:-1])))
                req.needs_penalty_reset = False
        return self._forward_batch(kv, positions, slots, [1] * len(self.reqs), resets, with_ids)

    def _forward_batch(
        self,
        kv: KVCacheManager,
        positions: torch.Tensor,
        slots: torch.Tensor,
        extend_lens: list[int],
        resets: list[tuple[int, list[int], list[int]]],
        with_ids: bool,
    ) -> ForwardBatch:
        assert self.input_ids is not None
        seq_lens = [r.kv.length for r in self.reqs]
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
        rows = self._rows(with_ids)
        # the sampled token lands right after the last cached position: at seq_len
        sampling = dataclasses.replace(rows.sampling, sample_positions=seq_lens_t,
                                       penalty_resets=penalty_resets(resets) if resets else None)
        return ForwardBatch(
            mode=self.mode,
            input_ids=self.input_ids,
            positions=positions,
            out_cache_loc=slots,
            req_pool_indices=rows.req_pool_indices,
            seq_lens=seq_lens,
            extend_lens=list(extend_lens),
            seq_lens_t=seq_lens_t,
            extend_lens_t=torch.tensor(extend_lens, dtype=torch.int64),
            sampling=sampling,
            return_logprob=rows.return_logprob,
            top_logprobs_num=rows.top_logprobs_num,
            table_writes=kv.req_to_token.take_writes(),
        )

    def _rows(self, with_ids: bool) -> Rows:
        """The rows' constant part: kept by a decode batch while its rows stay, built anew for
        every extend."""
        rows = self.rows_kept
        if self.mode != "decode" or rows is None or rows.with_ids != with_ids:
            rows = Rows.of(self.reqs, with_ids)
            self.rows_kept = rows if self.mode == "decode" else None
        return rows


@dataclass(frozen=True)
class Rows:
    """What a batch's rows keep from one decode step to the next while they stay the same: their
    sampling parameters (each step sets its sample positions and penalty resets), their table
    rows, and what they asked to get back."""

    sampling: SamplingBatchInfo
    req_pool_indices: torch.Tensor
    return_logprob: bool
    top_logprobs_num: int
    with_ids: bool

    @classmethod
    def of(cls, reqs: list[Req], with_ids: bool) -> Rows:
        return cls(build_sampling_info(reqs, with_ids),
                   torch.tensor([r.kv.row for r in reqs], dtype=torch.int64),
                   any(r.return_logprob for r in reqs),
                   max((r.top_logprobs_num for r in reqs), default=0), with_ids)


def build_sampling_info(reqs: list[Req], with_ids: bool = False) -> SamplingBatchInfo:
    """One row per request, in `reqs` order (sample positions: where each one's next token
    lands; no penalty resets); the optional tensors (request identity, penalties, logit bias)
    are set only when some row needs them."""
    params = [r.sampling_params for r in reqs]
    info = _base_sampling_info(reqs, params)
    if with_ids:  # the rid hash and bootstrap room of each row (-1: none)
        info.rids_int = rids_to_tensor(r.rid for r in reqs)
        info.bootstrap_room_ids_int = rooms_to_tensor(r.bootstrap_room for r in reqs)
    if any(p.uses_penalties for p in params):
        _add_penalties(info, params)
    if any(p.logit_bias for p in params):
        _add_logit_bias(info, params)
    return info


def _base_sampling_info(reqs: list[Req], params: list[SamplingParams]) -> SamplingBatchInfo:
    """Temperature, top-k/p, min-p, seed and sample position of each row."""
    temps = [0.0 if p.is_greedy else p.temperature for p in params]
    vocab_cap = 1 << 30  # "no top-k": larger than any vocabulary
    top_ks = [p.top_k if p.top_k > 0 else vocab_cap for p in params]
    return SamplingBatchInfo(
        temperatures=torch.tensor(temps, dtype=torch.float32),
        top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32),
        top_ks=torch.tensor(top_ks, dtype=torch.int64),
        min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32),
        seeds=torch.tensor([r.seed for r in reqs], dtype=torch.int64),
        # the sampled token lands right after the last cached position
        sample_positions=torch.tensor([r.kv.length for r in reqs], dtype=torch.int64),
        all_greedy=all(t == 0.0 for t in temps),
        need_top_k=any(p.top_k > 0 for p in params),
        need_top_p=any(p.top_p < 1.0 for p in params),
        need_min_p=any(p.min_p > 0.0 for p in params),
        max_top_k=max(top_ks),
    )


def _add_penalties(info: SamplingBatchInfo, params: list[SamplingParams]) -> None:
    info.repetition_penalties = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
    info.frequency_penalties = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
    info.presence_penalties = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)


def _add_logit_bias(info: SamplingBatchInfo, params: list[SamplingParams]) -> None:
    """(rows, token ids, biases): one entry per biased token of each row."""
    entries = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias]
    rows, tokens, biases = zip(*entries, strict=True)
    info.logit_bias = (torch.tensor(rows, dtype=torch.int64),
                       torch.tensor(tokens, dtype=torch.int64),
                       torch.tensor(biases, dtype=torch.float32))


def penalty_resets(resets: list[tuple[int, list[int], list[int]]]) -> PenaltyResets:
    """(row, prompt tokens, output tokens so far) per request, as PenaltyResets tensors."""
    seen = [(row, t) for row, prompt, output in resets for t in (*prompt, *output)]
    counted = [(row, t) for row, _, output in resets for t in output]

    def pairs(rows_tokens: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.tensor(rows_tokens, dtype=torch.int64).view(-1, 2)
        return both[:, 0], both[:, 1]

    rows = torch.tensor([row for row, _, _ in resets], dtype=torch.int64)
    return (rows, *pairs(seen), *pairs(counted))
