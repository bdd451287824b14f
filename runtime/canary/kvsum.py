"""Byte checksums of KV slots (`--kv-canary-bytes`): one int64 per slot over the raw bits of its
K and V, in every layer (`all`) or the first and last layers only (`partial`: cheaper, blind to
the layers between).

    sum(slot) = sum over elements e of bits(e) * w(e)   (int64, wrapping)

with bits(e) the element's bits as an integer and w(e) odd, fixed per element position: any
change to one element changes the sum (an odd weight times a nonzero change is nonzero modulo
2^64), and a change that moves bits from one element to another almost surely does too.

Under tensor parallelism each rank's pool holds its own KV heads (runtime/models/parallel.py),
and the weights are indexed by the model's KV head, not the rank's: w(layer, K/V, head, dim)
over the model's heads, of which a rank uses the rows of the heads it holds. A rank's sum of a
slot is then a *partial* sum, and the whole-model sum is the sum of the partials over the ranks
that own their heads (`HeadSplit.counted`): a KV head copied on several ranks (fewer KV heads
than ranks) counts once, from the first rank that holds it, as runtime/disagg/shares.py sends
it from there. So the sum of a slot is the same whatever the TP: a prefill with tp 2 and a
decode with tp 1 agree on it. A copy's partial uses the same weights as its owner's and equals
it while the two hold the same bytes, which is how a copy is checked (runtime/canary/ranks.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from runtime.canary.oracle import mix64
from runtime.kvcache.pool import KVPool

BytesMode = Literal["none", "partial", "all"]
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class HeadSplit:
    """How the TP ranks divide the model's KV heads, seen from `rank` (the one whose pool this
    is): `held[r]` is rank r's KV heads [lo, hi) of the model's (TensorParallel.kv_split)."""

    held: tuple[tuple[int, int], ...]
    rank: int = 0

    @classmethod
    def one_rank(cls, kv_heads: int) -> HeadSplit:
        return cls(((0, kv_heads),))

    @property
    def size(self) -> int:
        return len(self.held)

    @property
    def total(self) -> int:
        """The model's KV heads."""
        return max(hi for _, hi in self.held)

    def owner(self, rank: int) -> int:
        """The first rank that holds the heads `rank` holds (itself unless they are copies)."""
        return self.held.index(self.held[rank])

    @property
    def counted(self) -> list[int]:
        """The ranks whose partial sums make up a slot's sum: each KV head's first holder."""
        return [r for r in range(self.size) if self.owner(r) == r]


class SlotSums:
    def __init__(self, pool: KVPool, mode: BytesMode, split: HeadSplit | None = None) -> None:
        """`split`: which of the model's KV heads `pool` holds (None: all of them)."""
        if mode == "none":
            raise ValueError("SlotSums with --kv-canary-bytes none")
        self.pool = pool
        self.split = split or HeadSplit.one_rank(pool.num_kv_heads)
        lo, hi = self.split.held[self.split.rank]
        assert hi - lo == pool.num_kv_heads, "the pool holds other heads than the split says"
        last = pool.num_layers - 1
        self.layers = list(range(pool.num_layers)) if mode == "all" else sorted({0, last})
        self.int_dtype = _INT_OF_SIZE[pool.buffer.element_size()]
        shape = (len(self.layers), 2, self.split.total, pool.head_dim)  # the model's heads
        n = torch.arange(1, 1 + shape[0] * shape[1] * shape[2] * shape[3], dtype=torch.int64)
        weights = (mix64(n) | 1).view(shape)  # odd, one per element
        self.weights = weights[:, :, lo:hi].contiguous().to(pool.device)  # this rank's heads

    def of(self, slots: torch.Tensor) -> torch.Tensor:
        """[N] int64 checksums of slots [N], read from the pool now (this rank's partial)."""
        pages, offsets = self.pool.locate(slots)
        buf = self.pool.buffer
        if len(self.layers) == self.pool.num_layers:
            x = buf[pages, :, :, offsets]  # [N, L, 2, H, D]
        else:
            x = torch.stack([buf[pages, layer, :, offsets] for layer in self.layers], dim=1)
        bits = x.contiguous().view(self.int_dtype).to(torch.int64)
        return (bits * self.weights).flatten(1).sum(1)
