"""CPU attention: TorchAttention whose decode reads the KV pool in place with a native kernel.

Decode is where the torch backend spends its attention time copying every request's pages into a
padded block before SDPA; csrc/paged_decode.cpp walks each request's slots directly instead
(native.py builds it). Extend (prefill) is unchanged: one SDPA per request.
An fp8 pool (--kv-cache-dtype fp8_e4m3) runs the kernel's fp8 twin, which reads each byte through
a 256-entry table of its value under the layer's scale (made once here, per layer, for K and for
V): the values KVPool's dequantize gives, so decode attends to what the torch backend does, and
extend, the torch backend's own, to its fresh K/V rounded as the pool holds them.
A layer with a sliding window runs the same kernel over the window alone: per request, the row
table from the window's first position and the window's length (built once per step for each
window, as the full table is), so the kernel itself knows nothing of windows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from runtime.attention.base import BackendUnavailable
from runtime.attention.native import load_paged_decode, load_paged_decode_fp8
from runtime.attention.torch_backend import TorchAttention
from runtime.forward_batch import ForwardBatch
from runtime.kvcache.fp8 import FP8, dequantize
from runtime.kvcache.pool import KVPool
from runtime.kvcache.req_to_token import ReqToTokenPool

HEAD_DIMS = (32, 64, 96, 128, 256)  # the kernel's compiled head sizes
MAX_GROUP = 16  # query heads per kv head


class CpuAttention(TorchAttention):
    def __init__(
        self, pool: KVPool, req_to_token: ReqToTokenPool, scale: float, op: Callable[..., None],
        windows: Sequence[int | None] = (),
    ) -> None:
        super().__init__(pool, req_to_token, scale, windows)
        self.op = op
        # an fp8 pool's [256] tables, per layer: (K's, V's)
        self.luts = [] if pool.scales is None else [
            (byte_values(k_scale), byte_values(v_scale))
            for k_scale, v_scale in zip(pool.scales.k, pool.scales.v, strict=True)]

    @classmethod
    def create(cls, pool: KVPool, req_to_token: ReqToTokenPool, scale: float,
               windows: Sequence[int | None] = ()) -> CpuAttention:
        if pool.device.type != "cpu" or pool.compute_dtype != torch.float32:
            raise BackendUnavailable(
                f"cpu attention needs a float32 CPU pool, not {pool.compute_dtype} on {pool.device}"
            )
        if pool.head_dim not in HEAD_DIMS:
            raise BackendUnavailable(f"cpu attention: head_dim {pool.head_dim} not in {HEAD_DIMS}")
        op = load_paged_decode() if pool.scales is None else load_paged_decode_fp8()
        if op is None:
            raise BackendUnavailable("cpu attention: the native kernel could not be built here")
        return cls(pool, req_to_token, scale, op, windows)

    def begin(self, batch: ForwardBatch) -> None:
        if batch.mode != "decode":
            super().begin(batch)
            return
        self.decode_batch: ForwardBatch | None = batch  # for the torch path, if a layer needs it
        self.out_loc = self.pool.locate(batch.out_cache_loc)
        self.seq_lens = batch.seq_lens_t  # [B]
        # [B, max_len] slot of every position of every request (rows are contiguous copies)
        self.slot_table = self.req_to_token.table[batch.req_pool_indices, : max(batch.seq_lens)]
        self.row_table = self.pool.row_offsets(self.slot_table)  # [B, max_len], every layer
        # per window (None: none), what the kernel reads: the rows and their lengths
        self.tables: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {
            None: (self.row_table, self.seq_lens)}
        for w in self.sliding_windows():
            self.tables[w] = window_rows(self.row_table, self.seq_lens, w)

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        b, h, d = q.shape
        if h // self.pool.num_kv_heads > MAX_GROUP:  # more than the kernel takes: plain torch
            if self.decode_batch is not None:
                super().begin(self.decode_batch)
                self.decode_batch = None
            return super()._decode(layer, q)
        out = torch.empty_like(q)  # [B, H, D]
        k_pages, v_pages = self.pool.pages(layer)
        rows, lens = self.tables[self.window(layer)]
        if self.luts:
            self.op(q.contiguous(), k_pages, v_pages, rows, lens, self.scale, *self.luts[layer], out)
        else:
            self.op(q.contiguous(), k_pages, v_pages, rows, lens, self.scale, out)
        return out.view(b, h * d)


def byte_values(scale: float) -> torch.Tensor:
    """[256] float32: what each float8_e4m3fn byte reads back as under `scale` (its NaN bytes
    NaN: the pool never stores one, as writes saturate)."""
    return dequantize(torch.arange(256, dtype=torch.uint8).view(FP8), scale, torch.float32)


def window_rows(rows: torch.Tensor, lens: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The row table [B, min(window, L)] and lengths [B] of each request's last `window`
    positions, from its full table rows [B, L] and lengths [B] (past a request's length: stale
    rows, never read)."""
    start = (lens - window).clamp(min=0)  # [B] the window's first position
    at = start[:, None] + torch.arange(min(window, rows.shape[1]), device=rows.device)[None, :]
    return rows.gather(1, at.clamp(max=rows.shape[1] - 1)), lens - start
