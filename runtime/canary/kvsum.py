"""Byte checksums of KV slots (`--kv-canary-bytes`): one int64 per slot over the raw bits of its
K and V, in every layer (`all`) or the first and last layers only (`partial`: cheaper, blind to
the layers between).

    sum(slot) = sum over elements e of bits(e) * w(e)   (int64, wrapping)

with bits(e) the element's bits as an integer and w(e) odd, fixed per element position: any
change to one element changes the sum (an odd weight times a nonzero change is nonzero modulo
2^64), and a change that moves bits from one element to another almost surely does too.
"""

from __future__ import annotations

from typing import Literal

import torch

from runtime.canary.oracle import mix64
from runtime.kvcache.pool import KVPool

BytesMode = Literal["none", "partial", "all"]
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class SlotSums:
    def __init__(self, pool: KVPool, mode: BytesMode) -> None:
        if mode == "none":
            raise ValueError("SlotSums with --kv-canary-bytes none")
        self.pool = pool
        last = pool.num_layers - 1
        self.layers = list(range(pool.num_layers)) if mode == "all" else sorted({0, last})
        self.int_dtype = _INT_OF_SIZE[pool.buffer.element_size()]
        shape = (len(self.layers), 2, pool.num_kv_heads, pool.head_dim)
        n = torch.arange(1, 1 + shape[0] * shape[1] * shape[2] * shape[3], dtype=torch.int64)
        self.weights = (mix64(n) | 1).view(shape).to(pool.device)  # odd, one per element

    def of(self, slots: torch.Tensor) -> torch.Tensor:
        """[N] int64 checksums of slots [N], read from the pool now."""
        pages, offsets = self.pool.locate(slots)
        buf = self.pool.buffer
        if len(self.layers) == self.pool.num_layers:
            x = buf[pages, :, :, offsets]  # [N, L, 2, H, D]
        else:
            x = torch.stack([buf[pages, layer, :, offsets] for layer in self.layers], dim=1)
        bits = x.contiguous().view(self.int_dtype).to(torch.int64)
        return (bits * self.weights).flatten(1).sum(1)
