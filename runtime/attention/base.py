"""Attention backends: one small interface, a registry, and lazy factories.

A backend computes attention for one layer over the paged KV pool. The model calls
`begin(batch)` once per forward and `forward(...)` once per layer. CUDA-only backends
(flashinfer, triton) register a factory that imports them only when chosen.

Registered: "torch" (plain torch, any device), "cpu" (torch plus a native decode kernel,
float32 on CPU), "flashinfer"/"triton" (CUDA, not implemented yet). "auto" (the default) picks
"cpu" for a CPU pool when it can be used there, else "torch".
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from runtime.engine.forward_batch import ForwardBatch
from runtime.kvcache.pool import KVPool
from runtime.kvcache.req_to_token import ReqToTokenPool

log = logging.getLogger(__name__)


class BackendUnavailable(RuntimeError):
    """This backend cannot run with this pool on this machine (the message says why)."""


class AttentionBackend(ABC):
    def __init__(self, pool: KVPool, req_to_token: ReqToTokenPool, scale: float) -> None:
        self.pool = pool
        self.req_to_token = req_to_token
        self.scale = scale

    @abstractmethod
    def begin(self, batch: ForwardBatch) -> None:
        """Build per-forward metadata (index tables, masks) shared by all layers."""

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """Write the new tokens' K/V into the pool, then attend.

        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] for the T new tokens.
        Returns [T, num_heads * head_dim]. Invariant: token t attends to every earlier position of
        its own request (from the pool) and to itself, never to another request.
        """


BackendFactory = Callable[[KVPool, ReqToTokenPool, float], AttentionBackend]
_REGISTRY: dict[str, BackendFactory] = {}


def register_attention_backend(name: str, factory: BackendFactory) -> None:
    _REGISTRY[name] = factory


def create_attention_backend(
    name: str, pool: KVPool, req_to_token: ReqToTokenPool, scale: float
) -> AttentionBackend:
    if name == "auto":
        if pool.k[0].device.type == "cpu":
            try:
                return _REGISTRY["cpu"](pool, req_to_token, scale)
            except BackendUnavailable as e:
                log.info("attention: %s; using 'torch'", e)
        return _REGISTRY["torch"](pool, req_to_token, scale)
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name](pool, req_to_token, scale)


def _torch_factory(pool: KVPool, req_to_token: ReqToTokenPool, scale: float) -> AttentionBackend:
    from runtime.attention.torch_backend import TorchAttention

    return TorchAttention(pool, req_to_token, scale)


def _cpu_factory(pool: KVPool, req_to_token: ReqToTokenPool, scale: float) -> AttentionBackend:
    from runtime.attention.cpu_backend import CpuAttention

    return CpuAttention.create(pool, req_to_token, scale)


def _cuda_only(name: str) -> BackendFactory:
    def factory(pool: KVPool, req_to_token: ReqToTokenPool, scale: float) -> AttentionBackend:
        raise NotImplementedError(
            f"attention backend {name!r} needs CUDA and is not implemented yet; use 'torch'"
        )

    return factory


register_attention_backend("torch", _torch_factory)
register_attention_backend("cpu", _cpu_factory)
register_attention_backend("flashinfer", _cuda_only("flashinfer"))
register_attention_backend("triton", _cuda_only("triton"))
