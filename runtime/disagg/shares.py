"""KV between servers with different tensor parallelism: which rank of the prefill writes which
KV heads into which rank of the decode.

Each rank of a server holds the KV of its own heads (runtime/models/parallel.py `kv_heads`: an
equal share, or, with fewer KV heads than ranks, the one head its query heads read, copied on
tp / heads ranks), in pages whose indexes mean the same slots on every rank. A room's KV
therefore moves as *shares*: prefill rank `src` writes KV heads [lo, hi) of the room's pages
into decode rank `dst`'s same pages. Every KV head a decode rank holds comes from exactly one
prefill rank: the first that holds it (`Split.owner`). P tp=2 -> D tp=1 is two shares, both into
decode rank 0 (each half of every page's heads); P tp=1 -> D tp=2 is two shares from the one
prefill rank (each page split by head range); equal TP is one share per rank pair.

In the page-major pool a page is [layer, K/V, token, head, dim]: a head range is one strided
run per (layer, K/V, token), which `head_slice` views (tcp gathers it into one block) and
`head_rows` lists as byte offsets (nixl writes each row as a descriptor of its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from runtime.disagg.wire import KVLayout


@dataclass(frozen=True)
class Split:
    """How a server's ranks divide the model's KV heads."""

    tp: int
    kv_heads: int

    def held(self, rank: int) -> tuple[int, int]:
        """The KV heads [lo, hi) rank `rank` holds (parallel.TensorParallel.kv_heads)."""
        if self.kv_heads >= self.tp:
            share = self.kv_heads // self.tp
            return rank * share, (rank + 1) * share
        head = rank * self.kv_heads // self.tp
        return head, head + 1

    def owner(self, head: int) -> int:
        """The first rank that holds KV head `head`: the one that sends it."""
        return next(r for r in range(self.tp) if self.held(r)[0] <= head < self.held(r)[1])


@dataclass(frozen=True)
class Share:
    src: int  # the prefill rank that writes
    dst: int  # the decode rank written
    lo: int  # KV heads [lo, hi) of the model
    hi: int

    @property
    def heads(self) -> int:
        return self.hi - self.lo


def plan(src: Split, dst: Split) -> list[Share]:
    """Every share of a room, by decode rank then head: together they write each KV head of
    every decode rank exactly once."""
    if src.kv_heads != dst.kv_heads:
        raise ValueError(f"{src.kv_heads} KV heads on one side, {dst.kv_heads} on the other")
    shares: list[Share] = []
    for d in range(dst.tp):
        lo, hi = dst.held(d)
        for head in range(lo, hi):
            s = src.owner(head)
            last = shares[-1] if shares else None
            if last is not None and (last.src, last.dst, last.hi) == (s, d, head):
                shares[-1] = Share(s, d, last.lo, head + 1)
            else:
                shares.append(Share(s, d, head, head + 1))
    return shares


def sources(shares: list[Share], dst: int) -> frozenset[int]:
    """The prefill ranks that write into decode rank `dst`."""
    return frozenset(s.src for s in shares if s.dst == dst)


def head_slice(pages: torch.Tensor, held: tuple[int, int], share: Share) -> torch.Tensor:
    """The share's heads of `pages` [n, layers, 2, page_size, heads held, head_dim] (a rank's
    pool pages), as a strided view."""
    first = held[0]
    return pages[:, :, :, :, share.lo - first:share.hi - first]


def whole(share: Share, *helds: tuple[int, int]) -> bool:
    """Whether `share` is every head each of these ranks holds: its pages move as whole pages."""
    return all((share.lo, share.hi) == held for held in helds)


def head_rows(pages: np.ndarray, held: tuple[int, int], share: Share,
              layout: KVLayout) -> tuple[np.ndarray, int]:
    """Where the share's heads lie in the pool of a rank holding heads `held`: the byte offset
    into its buffer of each (page, layer, K/V, token) row of heads [share.lo, share.hi), in
    that order (`pages` [n] -> [n * layers * 2 * page_size]), and the bytes of one row. A
    prefill rank's rows and a decode rank's rows of the same share pair up one to one."""
    item = layout.head_bytes // (2 * layout.num_layers * layout.page_size * layout.head_dim)
    head = layout.head_dim * item  # bytes of one head of one (layer, K/V, token) row
    row = (held[1] - held[0]) * head  # a row of every head the rank holds
    per_page = 2 * layout.num_layers * layout.page_size
    offsets = (np.asarray(pages, dtype=np.int64)[:, None] * (per_page * row)
               + np.arange(per_page, dtype=np.int64)[None, :] * row
               + (share.lo - held[0]) * head)
    return offsets.reshape(-1), share.heads * head
