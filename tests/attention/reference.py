"""Attention straight from its definition, in float64: what the kernel tests and the flashinfer
stand-in compute."""

from __future__ import annotations

import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_pos: torch.Tensor,
                     scale: float, window: int | None = None) -> torch.Tensor:
    """float64 attention of q [n, H, D] (at positions query_pos [n]) over k, v [L, KVH, D]
    (positions 0..L-1, grouped-query heads): row i sees keys 0..query_pos[i], with a window only
    the last `window` of them. Returns [n, H, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)  # [L, H, D]
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    keys, queries = torch.arange(len(k), device=q.device)[None, :], query_pos[:, None]
    visible = (keys <= queries) & (keys > queries - (window or len(k) + 1))
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)
