"""The attention backend interface (registry.py creates backends by name).

A backend computes attention for one layer over the paged KV pool. The model calls
`begin(batch)` once per forward and `forward(...)` once per layer. What the model asks of every
forward is fixed when the backend is made: the scale of q . k and each layer's sliding window
(Gemma 3, Mistral); a backend that cannot honour them raises BackendUnavailable there, at
start-up, rather than compute something else.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

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

    def __init__(self, pool: KVPool, req_to_token: ReqToTokenPool, scale: float,
                 windows: Sequence[int | None] = ()) -> None:
        """windows: per layer, how many of the latest positions a query sees, itself included
        (None, or a layer past the end: every position; ModelConfig.sliding_windows)."""
        self.pool = pool
        self.req_to_token = req_to_token
        self.scale = scale
        self.windows = tuple(windows)

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it sees every earlier position)."""
        return self.windows[layer] if layer < len(self.windows) else None

    def sliding_windows(self) -> set[int]:
        """The distinct windows of the sliding layers (what begin() prepares for)."""
        return {w for w in self.windows if w is not None}

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
        Returns [T, num_heads * head_dim]. Invariant: token t at position p attends to every
        earlier position of its own request (from the pool) and to itself, never to another
        request; in a layer with a window W only to positions p - W + 1 .. p (HF's rule:
        key > query - W). Every position's KV stays in the pool, windowed layers included.
        """
