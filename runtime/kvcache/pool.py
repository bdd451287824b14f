"""The KV pool: per layer one K and one V buffer, allocated once at start-up.

Nothing may reallocate or resize these buffers while serving: transfer backends register them
once and address pages by (layer, page index).
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_slots, num_kv_heads, head_dim)
        # [num_slots, num_kv_heads, head_dim] per layer
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V. slots: [T]; k, v: [T, num_kv_heads, head_dim]."""
        self.k[layer][slots] = k
        self.v[layer][slots] = v

    @property
    def bytes_per_slot(self) -> int:
        k0 = self.k[0]
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * k0.element_size()
