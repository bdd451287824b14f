"""The KV pool: per layer one K and one V buffer, allocated once at start-up.

Nothing may reallocate or resize these buffers while serving: transfer backends register them
once and address pages by (layer, page index). Page p is slots [p * page_size, (p + 1) * page_size),
and a request's position i always lives in slot `pages[i // page_size] * page_size + i % page_size`
(KVCacheManager.grow), so whole pages can be copied or gathered as blocks.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_slots = num_pages * page_size
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

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [num_pages, page_size, num_kv_heads, head_dim] views."""
        shape = (self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        return self.k[layer].view(shape), self.v[layer].view(shape)

    @property
    def bytes_per_slot(self) -> int:
        k0 = self.k[0]
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * k0.element_size()
