"""Sampler backends: a small ABC, a registry, and the default `torch` sampler.

A backend turns (already penalized) logits into one token per row. It may also return
`customized_info`: key -> one value per row, which flows out with each request's output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from runtime.canary.oracle import GOLDEN, identities, lsr, mix64, oracle_tokens
from runtime.forward_batch import SamplingBatchInfo


@dataclass
class SamplerOutput:
    next_token_ids: torch.Tensor  # [B] int64
    customized_info: dict[str, list[Any]] | None = None


class SamplerBackend(ABC):
    # True: the batch must carry rids_int / bootstrap_room_ids_int (seed 002)
    needs_request_ids = False

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    @abstractmethod
    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SamplerOutput:
        """logits: [B, vocab] float32 -> one token per row."""


_REGISTRY: dict[str, type[SamplerBackend]] = {}


def register_sampler_backend(name: str, cls: type[SamplerBackend]) -> None:
    if not (isinstance(cls, type) and issubclass(cls, SamplerBackend)):
        raise TypeError(f"sampler backend {name!r} must subclass SamplerBackend")
    _REGISTRY[name] = cls


def create_sampler_backend(name: str, vocab_size: int) -> SamplerBackend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown sampler backend {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name](vocab_size)


def uniform_from_seed(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Deterministic U[0,1) per row from (seed, position): splitmix64 finalizer on int64 lanes."""
    mix = mix64(seeds.to(torch.int64) * (GOLDEN - (1 << 64)) + positions)
    return lsr(mix, 11).double().mul_(2.0**-53)  # top 53 bits -> [0, 1)


class TorchSampler(SamplerBackend):
    """Greedy, temperature, top-k, top-p, min-p; seeded draws by inverse CDF."""

    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SamplerOutput:
        greedy = logits.argmax(dim=-1)
        if info.all_greedy:
            return SamplerOutput(greedy)
        temps = info.temperatures.clamp(min=1e-6).unsqueeze(1)
        probs = torch.softmax(logits / temps, dim=-1)  # [B, V]
        candidates, ids = self._candidates(probs, info)  # sorted desc when truncating
        if info.need_top_k:
            ranks = torch.arange(candidates.shape[1], device=logits.device).unsqueeze(0)
            candidates = candidates.masked_fill(ranks >= info.top_ks.unsqueeze(1), 0.0)
        if info.need_top_p:
            before = candidates.cumsum(dim=-1) - candidates  # mass strictly above each candidate
            candidates = candidates.masked_fill(before > info.top_ps.unsqueeze(1), 0.0)
        if info.need_min_p:
            floor = candidates.max(dim=-1, keepdim=True).values * info.min_ps.unsqueeze(1)
            candidates = candidates.masked_fill(candidates < floor, 0.0)
        cdf = candidates.double().cumsum(dim=-1)  # [B, C]
        u = uniform_from_seed(info.seeds, info.sample_positions).unsqueeze(1) * cdf[:, -1:]
        pick = torch.searchsorted(cdf, u).clamp(max=cdf.shape[1] - 1)  # [B, 1]
        sampled = pick.squeeze(1) if ids is None else ids.gather(1, pick).squeeze(1)
        return SamplerOutput(torch.where(info.temperatures == 0, greedy, sampled))

    def _candidates(
        self, probs: torch.Tensor, info: SamplingBatchInfo
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (probs, their token ids) — sorted descending when top-k/top-p need ranks."""
        if info.need_top_k and not info.need_top_p:
            k = info.max_top_k
            if k < probs.shape[1]:
                values, ids = probs.topk(k, dim=-1)
                return values, ids
        if info.need_top_k or info.need_top_p:
            values, ids = probs.sort(dim=-1, descending=True)
            return values, ids
        return probs, None


class TokenOracleSampler(SamplerBackend):
    """Ignores the logits: each row's token is the oracle's (runtime/canary/oracle.py), so any
    run, colocated or disaggregated, can be checked token by token without knowing the weights."""

    needs_request_ids = True

    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SamplerOutput:
        if info.rids_int is None or info.bootstrap_room_ids_int is None:
            raise RuntimeError("token_oracle needs rids_int and bootstrap_room_ids_int in the batch")
        ids = identities(info.rids_int, info.bootstrap_room_ids_int)
        tokens = oracle_tokens(ids, info.sample_positions, self.vocab_size)
        return SamplerOutput(tokens.to(logits.device))


register_sampler_backend("torch", TorchSampler)
register_sampler_backend("token_oracle", TokenOracleSampler)
