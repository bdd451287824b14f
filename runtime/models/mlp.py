"""A layer's feed-forward: the dense gated MLP (SiLU, or Gemma's GELU), or a sparse mixture of
experts (moe.py).

Both are called as `mlp(h, ops)` on the normed residual h [T, hidden] and return what the layer
adds to the residual stream [T, hidden]; `ops` is the model's small-op set (torch or Triton).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from runtime.models.linear import Matmul


class SmallOps(Protocol):
    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor: ...


class FeedForward(Protocol):
    cuda_graph_safe: bool  # makes no host sync (a decode step with it can be captured)

    def __call__(self, h: torch.Tensor, ops: SmallOps) -> torch.Tensor: ...


class GatedMLP:
    """down(SiLU(gate(h)) * up(h)), gate and up fused into one matmul."""

    cuda_graph_safe = True

    def __init__(self, gate_up: Matmul, down: Matmul) -> None:
        self.gate_up, self.down = gate_up, down  # hidden -> 2 * inter; inter -> hidden

    def __call__(self, h: torch.Tensor, ops: SmallOps) -> torch.Tensor:
        return self.down(ops.silu_mul(self.gate_up(h)))


class GeGLU(GatedMLP):
    """down(GELU(gate(h)) * up(h)), GELU by its tanh approximation (Gemma's
    `gelu_pytorch_tanh`), in torch ops on every device."""

    def __call__(self, h: torch.Tensor, ops: SmallOps) -> torch.Tensor:
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down(F.gelu(gate, approximate="tanh") * up)
