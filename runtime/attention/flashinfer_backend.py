"""flashinfer attention: its paged decode and prefill wrappers over our KV pool, planned per forward.

flashinfer reads a paged cache through a page table: per request, the indices of its pages in
order (`indptr` into one flat `indices`) and how many slots of its last page are used. Our pool
is page-major with every layer in one buffer; one layer's K (or V) is a strided view
[num_pages, page_size, kv_heads, head_dim] whose page stride spans all layers, which flashinfer
takes as it is (it reads strides, flashinfer 0.7 page.cuh). The page table comes from what we
have already: `indptr` and `last_page_len` from the host's sequence lengths (flashinfer's plan()
wants them on the host), the page indices gathered on the device from the req->token table
(slot // page_size of each page's first position), so planning never waits for the device.
The new tokens' K/V are written to the pool first, as in the other backends; prefill is causal
over each request's cached prefix and its new tokens.

flashinfer has no float32 kernels: a float32 pool is BackendUnavailable (use triton or bf16).
An fp8 pool (--kv-cache-dtype fp8_e4m3) flashinfer reads natively: plan() takes the pages'
dtype (`kv_data_type` float8_e4m3fn, `q_data_type` the model's), run() the layer's scales
(`k_scale`, `v_scale`: flashinfer folds K's into the softmax scale and multiplies the output by
V's), as sglang and vLLM pass them. The new tokens are written by KVPool.write, quantized as
every backend quantizes them.
Nor is its sliding window (`window_left`, a plan() argument) wired here: a model with
sliding-window layers (Gemma 3) is BackendUnavailable too (use triton or torch).

Decode graphs: plan() is host work, which a replay does not redo, so each captured batch size
gets a decode wrapper in flashinfer's CUDA-graph mode, whose page table lives in fixed device
buffers (shared by all sizes: one graph runs at a time, in stream order); the decode graphs call
plan_graph() outside the graph, before the capture and before every replay, which fills them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from runtime.attention.base import AttentionBackend, BackendUnavailable
from runtime.forward_batch import ForwardBatch
from runtime.kvcache.pool import KVPool
from runtime.kvcache.req_to_token import ReqToTokenPool

WORKSPACE_BYTES = 128 << 20
# Decode runs on tensor cores past this GQA group size (sglang's and vLLM's rule: faster there;
# the CUDA-core kernels cover the small groups in every flashinfer version).
TENSOR_CORES_ABOVE_GROUP = 4


def page_counts(seq_lens: list[int], page_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Host side of the page table: indptr [B + 1] and last_page_len [B] (int32, on the host),
    and the total number of pages."""
    pages = [-(-n // page_size) for n in seq_lens]
    indptr = torch.zeros(len(pages) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(pages, dtype=torch.int32).cumsum(0)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(seq_lens, pages, strict=True)],
                        dtype=torch.int32)
    return indptr, last, int(indptr[-1])


def page_indices(
    table: torch.Tensor, req_idx: torch.Tensor, seq_lens: torch.Tensor, page_size: int, total: int
) -> torch.Tensor:
    """Device side: the pages of each request in order, flat ([total] int32, on the table's
    device). `total` (the host's count) sizes the output, so nothing is read back."""
    pages = (seq_lens + page_size - 1) // page_size  # [B]
    owner = torch.repeat_interleave(torch.arange(len(pages), device=table.device), pages,
                                    output_size=total)  # [total] request of each page
    first = torch.cumsum(pages, 0) - pages  # [B] where each request's pages start
    nth = torch.arange(total, device=table.device) - first[owner]  # [total] page number within
    slots = table[req_idx[owner], nth * page_size]  # the slot of each page's first position
    return (slots // page_size).to(torch.int32)


class FlashInferAttention(AttentionBackend):
    cuda_graph_safe = True  # through plan_graph(): see the module's docstring

    @classmethod
    def create(cls, pool: KVPool, req_to_token: ReqToTokenPool, scale: float,
               windows: Sequence[int | None] = ()) -> FlashInferAttention:
        if any(w is not None for w in windows):
            raise BackendUnavailable(
                "flashinfer attention: sliding-window layers are not wired to flashinfer here: "
                "use --attention-backend triton (head_dim up to 128) or torch"
            )
        try:
            import flashinfer
        except ImportError:
            raise BackendUnavailable(
                "flashinfer attention: the flashinfer package is not installed "
                "(pip install 'baton[cuda]')"
            ) from None
        if pool.device.type != "cuda":
            raise BackendUnavailable(f"flashinfer attention needs a CUDA pool, not {pool.device}")
        if pool.compute_dtype not in (torch.float16, torch.bfloat16):
            raise BackendUnavailable(
                f"flashinfer attention has no {pool.compute_dtype} kernels: use --dtype bfloat16, "
                "or --attention-backend triton"
            )
        return cls(pool, req_to_token, scale, flashinfer)

    def __init__(self, pool: KVPool, req_to_token: ReqToTokenPool, scale: float, flashinfer: Any) -> None:
        super().__init__(pool, req_to_token, scale)
        self.flashinfer = flashinfer
        # what run() takes besides q and the pages, per layer: an fp8 pool's scales
        scales = pool.scales
        self.run_args: list[dict[str, float]] = (
            [{}] * pool.num_layers if scales is None
            else [{"k_scale": k, "v_scale": v} for k, v in zip(scales.k, scales.v, strict=True)])
        # zeroed: flashinfer asks for a workspace initialised to 0 before its first use
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode: Any = None  # made at the first decode: its kernels depend on the GQA group
        self.graph_decode: dict[int, Any] = {}  # captured batch size -> its CUDA-graph wrapper
        self.graph_table: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.graph_batch: ForwardBatch | None = None  # the static batch plan_graph planned last
        self.batch: ForwardBatch | None = None  # begun, not yet planned
        self.wrapper: Any = None  # what this forward's layers run
        self.planned: Any = None  # torch.cuda.Event after the last plan's copies

    def begin(self, batch: ForwardBatch) -> None:
        """Where the new tokens go. A captured decode forward runs what plan_graph planned; any
        other waits for the first layer to plan, which knows the number of query heads."""
        self.out_loc = self.pool.locate(batch.out_cache_loc)
        if batch is self.graph_batch:
            self.wrapper, self.batch = self.graph_decode[batch.batch_size], None
        else:
            self.batch = batch

    def plan_graph(self, batch: ForwardBatch, num_heads: int) -> None:
        size = batch.batch_size
        if size not in self.graph_decode:
            self.graph_decode[size] = self._decode_wrapper(num_heads, size)
        self._plan(batch, num_heads, self.graph_decode[size])
        self.graph_batch = batch

    def _decode_wrapper(self, num_heads: int, graph_size: int = 0) -> Any:
        """An eager decode wrapper, or (graph_size > 0) one in CUDA-graph mode for that batch
        size, reading its page table from the shared fixed buffers."""
        tensor_cores = num_heads // self.pool.num_kv_heads > TENSOR_CORES_ABOVE_GROUP
        make = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper
        if not graph_size:
            return make(self.workspace, "NHD", use_tensor_cores=tensor_cores)
        if self.graph_table is None:
            # Pages of a padded batch: each request's own (at most the pool's) plus one scratch
            # page per padding row (at most one per table row).
            rows, device = self.req_to_token.table.shape[0], self.pool.device
            self.graph_table = (torch.zeros(rows + 1, dtype=torch.int32, device=device),
                                torch.zeros(self.pool.num_pages + rows, dtype=torch.int32, device=device),
                                torch.zeros(rows, dtype=torch.int32, device=device))
        indptr, indices, last = self.graph_table
        return make(self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
                    paged_kv_indptr_buffer=indptr[: graph_size + 1],
                    paged_kv_indices_buffer=indices,
                    paged_kv_last_page_len_buffer=last[:graph_size])

    def _eager_wrapper(self, batch: ForwardBatch, num_heads: int) -> Any:
        if batch.mode != "decode":
            return self.prefill
        if self.decode is None:
            self.decode = self._decode_wrapper(num_heads)
        return self.decode

    def _plan(self, batch: ForwardBatch, num_heads: int, wrapper: Any) -> None:
        """Plan `batch` on `wrapper` (a decode wrapper for a decode batch, else the prefill one)."""
        pool = self.pool
        indptr, last, total = page_counts(batch.seq_lens, pool.page_size)
        indices = page_indices(self.req_to_token.table, batch.req_pool_indices, batch.seq_lens_t,
                               pool.page_size, total)
        args = (num_heads, pool.num_kv_heads, pool.head_dim, pool.page_size)
        common = {"q_data_type": pool.compute_dtype, "kv_data_type": pool.dtype,
                  "sm_scale": self.scale}
        # NOTE: plan() stages its metadata in one pinned host buffer and copies it asynchronously;
        # the next plan must not overwrite it before that copy ran (the CPU may run a forward
        # ahead in overlap mode), so it waits for the previous plan's event (passed long since,
        # in practice).
        if self.planned is not None:
            self.planned.synchronize()
        if batch.mode == "decode":
            wrapper.plan(indptr, indices, last, *args, **common)
        else:
            qo_indptr = torch.zeros(batch.batch_size + 1, dtype=torch.int32)
            qo_indptr[1:] = torch.tensor(batch.extend_lens, dtype=torch.int32).cumsum(0)
            wrapper.plan(qo_indptr, indptr, indices, last, *args, causal=True, **common)
        if pool.device.type == "cuda":  # (the CPU runs a stand-in for flashinfer in tests)
            self.planned = torch.cuda.Event()
            self.planned.record()

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        self.pool.write(layer, self.out_loc, k, v)
        if self.batch is not None:  # the first layer of an eager forward
            self.wrapper = self._eager_wrapper(self.batch, q.shape[1])
            self._plan(self.batch, q.shape[1], self.wrapper)
            self.batch = None
        # (K, V) strided layer views; an fp8 pool's layer scales
        out = self.wrapper.run(q.contiguous(), self.pool.pages(layer), **self.run_args[layer])
        return out.view(out.shape[0], -1)
