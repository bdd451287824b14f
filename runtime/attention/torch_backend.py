"""Plain-torch attention over the paged KV pool (CPU and any device).

Decode: one gather of every request's K/V into a padded [B, L] block and one SDPA call per layer.
Extend: one SDPA per request; a request with no cached prefix attends to its fresh K/V directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.attention.base import AttentionBackend
from runtime.engine.forward_batch import ForwardBatch


class TorchAttention(AttentionBackend):
    def begin(self, batch: ForwardBatch) -> None:
        seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int64)
        max_len = max(batch.seq_lens)
        # [B, L] slot of every position of every request (stale past each request's length)
        self.slot_table = self.req_to_token.table[batch.req_pool_indices, :max_len]
        self.flat_slots = self.slot_table.reshape(-1)
        if batch.mode == "decode":
            valid = torch.arange(max_len)[None, :] < seq_lens[:, None]  # [B, L]
            # [B, 1, 1, L] boolean mask: True = may attend
            self.decode_mask = valid[:, None, None, :]
            self.uniform = bool((seq_lens == max_len).all())
        else:
            self.extend_offsets = [0]
            for n in batch.extend_lens:
                self.extend_offsets.append(self.extend_offsets[-1] + n)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        self.pool.write(layer, batch.out_cache_loc, k, v)
        if batch.mode == "decode":
            return self._decode(layer, q)
        return self._extend(layer, q, k, v, batch)

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        b, h, d = q.shape
        shape = (*self.slot_table.shape, self.pool.num_kv_heads, d)
        # [B, L, kv_heads, D] -> [B, kv_heads, L, D]
        keys = self.pool.k[layer].index_select(0, self.flat_slots).view(shape).transpose(1, 2)
        values = self.pool.v[layer].index_select(0, self.flat_slots).view(shape).transpose(1, 2)
        mask = None if self.uniform else self.decode_mask
        out = F.scaled_dot_product_attention(
            q.view(b, h, 1, d), keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
        )
        return out.reshape(b, h * d)  # [B, H*D]

    def _extend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        outs = []
        for i, (prefix, n) in enumerate(zip(batch.prefix_lens, batch.extend_lens, strict=True)):
            lo, hi = self.extend_offsets[i], self.extend_offsets[i + 1]
            qi = q[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if prefix == 0:
                ki, vi, mask, causal = k[lo:hi], v[lo:hi], None, True
            else:
                slots = self.slot_table[i, : prefix + n]
                ki, vi = self.pool.k[layer][slots], self.pool.v[layer][slots]
                # query j (absolute position prefix + j) sees keys 0..prefix + j
                mask = torch.ones(n, prefix + n, dtype=torch.bool).tril(diagonal=prefix)
                causal = False
            out = F.scaled_dot_product_attention(
                qi,
                ki.transpose(0, 1).unsqueeze(0),
                vi.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                scale=self.scale,
                enable_gqa=True,
            )
            outs.append(out[0].transpose(0, 1).reshape(n, -1))  # [n, H*D]
        return torch.cat(outs) if len(outs) > 1 else outs[0]
