"""A stand-in for flashinfer's two paged wrappers, in torch on the CPU, so the CPU suite runs
baton's real FlashInferAttention (its page tables, when it plans, its decode-graph buffers)
through an Engine. flashinfer itself needs CUDA: tests/gpu runs the real one.

What it keeps of flashinfer's contract (flashinfer 0.7, decode.py / prefill.py) is what baton
relies on:
- plan(indptr, indices, last_page_len, ...) takes int32 page tables, `last_page_len` in 1..page
  size; the prefill plan takes qo_indptr first and `causal`; q must be the planned q_data_type.
- run(q, (k_cache, v_cache), k_scale=, v_scale=) reads NHD caches [num_pages, page_size,
  kv_heads, head_dim] (any strides) of the planned kv_data_type (an fp8 pool's float8_e4m3fn:
  each value times k_scale or v_scale, 1.0 when not given) and returns [rows, heads, head_dim];
  causal rows align to the end of the sequence.
- In CUDA-graph mode the batch size is fixed by the buffers given to the constructor, plan()
  copies the table into them (ValueError on another batch size or too many pages), and run()
  reads them: a replayed kernel sees whatever the last plan wrote there, nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from runtime.attention.base import BackendUnavailable
from runtime.attention.flashinfer_backend import FlashInferAttention
from runtime.kvcache.pool import KVPool
from runtime.kvcache.req_to_token import ReqToTokenPool
from tests.attention.reference import causal_attention


def backend(pool: KVPool, req_to_token: ReqToTokenPool, scale: float,
            windows: Sequence[int | None] = ()) -> FlashInferAttention:
    """baton's flashinfer backend over this stand-in (any device, any dtype); sliding windows
    refused as FlashInferAttention.create refuses them."""
    import tests.attention.flashinfer_standin as module

    if any(w is not None for w in windows):
        raise BackendUnavailable("flashinfer attention: sliding-window layers are not wired")
    return FlashInferAttention(pool, req_to_token, scale, module)


class _Paged:
    def __init__(
        self,
        workspace: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
    ) -> None:
        assert kv_layout == "NHD"
        self.graph: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if use_cuda_graph:
            buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
            if not all(torch.is_tensor(b) for b in buffers):
                raise ValueError("CUDA-graph mode needs the three page-table buffers")
            self.graph = buffers  # type: ignore[assignment]
            if len(self.graph[0]) != len(self.graph[2]) + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
        self.table: tuple[torch.Tensor, ...] = ()
        self.plans = 0

    def _plan(self, qo_indptr: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
              last: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int,
              page_size: int, causal: bool, q_data_type: torch.dtype, kv_data_type: torch.dtype,
              sm_scale: float) -> None:
        assert indptr.dtype == indices.dtype == last.dtype == qo_indptr.dtype == torch.int32
        assert int(last.min()) >= 1 and int(last.max()) <= page_size
        assert len(indices) == int(indptr[-1])
        if self.graph is not None:
            g_indptr, g_indices, g_last = self.graph
            if len(last) != len(g_last):
                raise ValueError(f"The batch size should be fixed in cudagraph mode: {len(last)} "
                                 f"vs {len(g_last)}")
            if len(indices) > len(g_indices):
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            g_indptr.copy_(indptr)
            g_indices[: len(indices)].copy_(indices)
            g_last.copy_(last)
            indptr, indices, last = g_indptr, g_indices, g_last
        else:
            indptr, indices, last = indptr.clone(), indices.clone(), last.clone()
        self.table = (qo_indptr.clone(), indptr, indices, last)
        self.shape = (num_qo_heads, num_kv_heads, head_dim, page_size)
        self.causal, self.q_dtype, self.kv_dtype, self.scale = causal, q_data_type, kv_data_type, sm_scale
        self.plans += 1

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
            k_scale: float | None = None, v_scale: float | None = None) -> torch.Tensor:
        k_cache, v_cache = paged_kv_cache
        k_scale, v_scale = (1.0 if s is None else s for s in (k_scale, v_scale))
        heads, kv_heads, head_dim, page_size = self.shape
        assert q.dtype == self.q_dtype and k_cache.dtype == self.kv_dtype
        assert q.shape[1:] == (heads, head_dim) and k_cache.shape[1:] == (page_size, kv_heads, head_dim)
        qo, indptr, indices, last = (t.tolist() for t in self.table)  # read at run time
        out = torch.empty_like(q)
        for b in range(len(last)):
            pages = indices[indptr[b] : indptr[b + 1]]
            n = (len(pages) - 1) * page_size + last[b]
            k = k_cache[pages].reshape(-1, kv_heads, head_dim)[:n].double() * k_scale  # [n, KVH, D]
            v = v_cache[pages].reshape(-1, kv_heads, head_dim)[:n].double() * v_scale
            rows = q[qo[b] : qo[b + 1]]
            # causal: row i sees keys up to n - len(rows) + i; else every key
            pos = n - len(rows) + torch.arange(len(rows)) if self.causal else torch.full((len(rows),), n - 1)
            out[qo[b] : qo[b + 1]] = causal_attention(rows, k, v, pos, self.scale).to(q.dtype)
        return out


class BatchDecodeWithPagedKVCacheWrapper(_Paged):
    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, **kw: Any) -> None:
        one_each = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._plan(one_each, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                   page_size, False, **kw)


class BatchPrefillWithPagedKVCacheWrapper(_Paged):
    def plan(self, qo_indptr: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
             last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, causal: bool = False, **kw: Any) -> None:
        self._plan(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                   page_size, causal, **kw)
