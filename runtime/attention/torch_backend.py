"""Plain-torch attention over the paged KV pool (CPU and any device).

Decode: one gather of every request's K/V pages into a padded [B, L] block (whole pages, so the
copy moves blocks rather than rows) and one SDPA call per layer.
Extend: one SDPA per request; a request with no cached prefix attends to its fresh K/V directly
(as the pool stores them: an fp8 pool's rounding included).
A layer with a sliding window is the same call under a mask that hides what lies before its
window (a windowed extend reads from the pool only the keys its first query can see).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.attention.base import AttentionBackend
from runtime.forward_batch import ForwardBatch


class TorchAttention(AttentionBackend):
    def begin(self, batch: ForwardBatch) -> None:
        self.out_loc = self.pool.locate(batch.out_cache_loc)  # where every layer writes
        max_len = max(batch.seq_lens)
        # [B, L] slot of every position of every request (stale past each request's length)
        self.slot_table = self.req_to_token.table[batch.req_pool_indices, :max_len]
        if batch.mode == "decode":
            ps = self.pool.page_size
            # [B * P] page of every page-start position; past a request's end: stale, masked
            self.page_ids = (self.slot_table[:, ::ps] // ps).reshape(-1)
            padded = self.slot_table[:, ::ps].shape[1] * ps
            positions = torch.arange(padded, device=self.pool.device)[None, :]
            lens = batch.seq_lens_t[:, None]
            uniform = all(n == padded for n in batch.seq_lens)  # no mask needed
            # per window (None: none), [B, 1, 1, P * ps] boolean masks: True = may attend
            self.decode_masks: dict[int | None, torch.Tensor | None] = {
                None: None if uniform else (positions < lens)[:, None, None, :]}
            for w in self.sliding_windows():
                self.decode_masks[w] = ((positions < lens) & (positions >= lens - w))[:, None, None, :]
        else:
            self.extend_offsets = [0]
            for n in batch.extend_lens:
                self.extend_offsets.append(self.extend_offsets[-1] + n)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        self.pool.write(layer, self.out_loc, k, v)
        if batch.mode == "decode":
            return self._decode(layer, q)
        return self._extend(layer, q, k, v, batch)

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        b, h, d = q.shape
        # [B * P, ps, kv_heads, D] -> [B, P * ps, kv_heads, D] -> [B, kv_heads, P * ps, D]
        k_pages, v_pages = self.pool.gather_pages(layer, self.page_ids)
        keys = k_pages.view(b, -1, self.pool.num_kv_heads, d)
        values = v_pages.view(b, -1, self.pool.num_kv_heads, d)
        out = F.scaled_dot_product_attention(
            q.view(b, h, 1, d),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=self.decode_masks[self.window(layer)],
            scale=self.scale,
            enable_gqa=True,
        )
        return out.reshape(b, h * d)  # [B, H*D]

    def _extend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        outs, window = [], self.window(layer)
        # NOTE: a request with no cached prefix attends to its fresh K/V as the pool holds them
        # (an fp8 pool rounds them), so its output does not depend on whether its prompt came
        # from the cache or a prefill chunk: cached == uncached holds token for token.
        k, v = self.pool.as_stored(layer, k, v)
        for i, (prefix, n) in enumerate(zip(batch.prefix_lens, batch.extend_lens, strict=True)):
            lo, hi = self.extend_offsets[i], self.extend_offsets[i + 1]
            qi = q[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            first = 0 if window is None else max(0, prefix - window + 1)  # first key it reads
            if prefix == 0:
                ki, vi = k[lo:hi], v[lo:hi]
            else:
                ki, vi = self.pool.read(layer, self.pool.locate(self.slot_table[i, first : prefix + n]))
            mask = None if prefix == 0 and window is None else visible(n, prefix, first, window, q.device)
            out = F.scaled_dot_product_attention(
                qi,
                ki.transpose(0, 1).unsqueeze(0),
                vi.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            outs.append(out[0].transpose(0, 1).reshape(n, -1))  # [n, H*D]
        return torch.cat(outs) if len(outs) > 1 else outs[0]


def visible(n: int, prefix: int, first: int, window: int | None,
            device: torch.device) -> torch.Tensor:
    """[n, prefix + n - first] bool: which keys (positions first .. prefix + n - 1) each of n
    queries at positions prefix .. prefix + n - 1 sees: those at or before its own position
    and, with a window, after its position - window."""
    queries = torch.arange(prefix, prefix + n, device=device)[:, None]
    keys = torch.arange(first, prefix + n, device=device)[None, :]
    sees = keys <= queries
    return sees if window is None else sees & (keys > queries - window)
