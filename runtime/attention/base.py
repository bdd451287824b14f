"""The attention backend interface (registry.py creates backends by name).

A backend computes attention for one layer over the paged KV pool. The model calls
`begin(batch)` once per forward and `forward(...)` once per layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from runtime.forward_batch import ForwardBatch
from runtime.kvcache.pool import KVPool
from runtime.kvcache.req_to_token import ReqToTokenPool


class BackendUnavailable(RuntimeError):
    """This backend cannot run with this pool on this machine (the message says why)."""


class AttentionBackend(ABC):
    # True: for a fixed batch size a decode forward keeps every shape and pointer, whatever the
    # sequence lengths, so it can be captured in a CUDA graph (runtime/engine/cuda_graph.py).
    cuda_graph_safe = False

    def __init__(self, pool: KVPool, req_to_token: ReqToTokenPool, scale: float) -> None:
        self.pool = pool
        self.req_to_token = req_to_token
        self.scale = scale

    @abstractmethod
    def begin(self, batch: ForwardBatch) -> None:
        """Build per-forward metadata (index tables, masks) shared by all layers."""

    def plan_graph(self, batch: ForwardBatch, num_heads: int) -> None:  # noqa: B027 (optional)
        """Host-side planning for a captured decode forward of `batch` (a graph's padded static
        batch, its buffers and `seq_lens` filled), run outside the graph before its capture and
        before every replay: what begin() does on the host, a replay cannot redo. None here: a
        graph-safe backend's begin() is device work alone."""

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """Write the new tokens' K/V into the pool, then attend.

        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] for the T new tokens.
        Returns [T, num_heads * head_dim]. Invariant: token t attends to every earlier position of
        its own request (from the pool) and to itself, never to another request.
        """
