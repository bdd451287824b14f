"""Decode graphs: the model's decode forward captured once per batch size, then replayed.

A decode step of a small model is launch-bound on a GPU: hundreds of small kernels, each a few
microseconds of Python and driver work. A CUDA graph replays them all in one launch. Graphs are
captured at start-up for a ladder of batch sizes (1, 2, 4, 8, 16, 24, ... up to
--cuda-graph-max-bs); a batch of n runs the graph of the smallest size >= n.

Replays read fixed buffers: the batch is copied into their first n rows, and the rows past n
are padding that points at the table's scratch row (ReqToTokenPool.scratch_row), whose one
position lives in a scratch page past the allocator's range, which no request ever gets:
padding writes its K/V there and attends to it, and its logits are dropped. What is captured is the model alone, embedding to logits;
penalties, logit_bias and sampling (the token oracle's request ids included) run after the
replay on the first n rows, so they need no padded copies. A backend that plans on the host
(flashinfer) does so outside the graph, before the capture and before every replay
(AttentionBackend.plan_graph), on the padded batch.

On CUDA a replay is a `torch.cuda.CUDAGraph`. Elsewhere (CPU tests) `EagerGraph` re-runs the same
function over the same buffers, so the padding and buffer logic is tested without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from runtime.attention.base import AttentionBackend
from runtime.forward_batch import ForwardBatch
from runtime.kvcache.pool import KVPool
from runtime.kvcache.req_to_token import ReqToTokenPool
from runtime.models.registry import CausalLM

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

log = logging.getLogger(__name__)

_INPUTS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens_t")


def batch_sizes(max_bs: int) -> list[int]:
    """The captured sizes: 1, 2, 4, 8, then every multiple of 8, up to and including max_bs."""
    sizes = [s for s in (1, 2, 4, 8, *range(16, max_bs + 1, 8)) if s <= max_bs]
    return sizes if sizes[-1] == max_bs else [*sizes, max_bs]


class Graph(Protocol):
    def replay(self) -> None: ...


class EagerGraph:
    """Runs the function at every replay: the CPU stand-in for a captured graph."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        fn()

    def replay(self) -> None:
        self.fn()


def capture_cuda_graph(
    fn: Callable[[], None], pool: _POOL_HANDLE, stream: torch.cuda.Stream
) -> Graph:
    """Warm `fn` up on `stream` (Triton compiles here), then capture it."""
    stream.wait_stream(torch.cuda.current_stream())  # the buffers were filled on the current one
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        fn()
    return graph


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        attn: AttentionBackend,
        pool: KVPool,
        req_to_token: ReqToTokenPool,
        scratch_page: int,
        vocab_size: int,
        max_bs: int,
        capture: Callable[[Callable[[], None]], Graph] | None = None,
    ) -> None:
        """scratch_page: a page of `pool` no request gets. capture: turns a function into a
        Graph; None: CUDA graphs on the pool's device."""
        if capture is None and not attn.cuda_graph_safe:
            raise ValueError(f"{type(attn).__name__} cannot run in a CUDA graph")
        device = pool.device
        self.sizes = batch_sizes(max_bs)
        self.max_bs = max_bs
        # Padding: the scratch row, whose position 0 is the scratch page's first slot.
        scratch_slot = scratch_page * pool.page_size
        req_to_token.table[req_to_token.scratch_row, 0] = scratch_slot
        self.padding = {"input_ids": 0, "positions": 0, "out_cache_loc": scratch_slot,
                        "req_pool_indices": req_to_token.scratch_row, "seq_lens_t": 1}
        self.buffers = {name: torch.full((max_bs,), value, dtype=torch.int64, device=device)
                        for name, value in self.padding.items()}
        self.logits = torch.empty((max_bs, vocab_size), dtype=torch.float32, device=device)
        self.batches: dict[int, ForwardBatch] = {}
        self.graphs: dict[int, Graph] = {}
        self.replays = 0  # decode steps run from a graph
        if capture is None:
            cuda_pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)

            def capture(fn: Callable[[], None]) -> Graph:
                return capture_cuda_graph(fn, cuda_pool, stream)

        self.attn, self.num_heads = attn, model.config.num_heads
        start = time.perf_counter()
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            batch = self._static_batch(size)
            self.batches[size] = batch
            attn.plan_graph(batch, self.num_heads)
            self.graphs[size] = capture(self._forward(model, attn, batch, size))
        log.info("decode graphs: %d batch sizes (1..%d) captured in %.1f s",
                 len(self.sizes), max_bs, time.perf_counter() - start)

    def _static_batch(self, size: int) -> ForwardBatch:
        views = {name: buf[:size] for name, buf in self.buffers.items()}
        return ForwardBatch(mode="decode", seq_lens=[1] * size, extend_lens=[1] * size,
                            extend_lens_t=torch.ones_like(views["seq_lens_t"]),
                            sampling=None, **views)  # type: ignore[arg-type]

    def _forward(
        self, model: CausalLM, attn: AttentionBackend, batch: ForwardBatch, size: int
    ) -> Callable[[], None]:
        def forward() -> None:
            self.logits[:size].copy_(model.forward(batch, attn, None))

        return forward

    def fits(self, batch: ForwardBatch) -> bool:
        return batch.mode == "decode" and batch.batch_size <= self.max_bs

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [n, vocab] of decode `batch` (staged on the device), from the graph."""
        n = batch.batch_size
        size = next(s for s in self.sizes if s >= n)
        for name in _INPUTS:
            buf = self.buffers[name]
            buf[:n].copy_(getattr(batch, name))
            if size > n:
                buf[n:size].fill_(self.padding[name])
        static = self.batches[size]
        # Lists are read only outside a CUDA graph (plan_graph; shapes in EagerGraph's re-runs).
        static.seq_lens = [*batch.seq_lens, *[1] * (size - n)]
        self.attn.plan_graph(static, self.num_heads)
        self.graphs[size].replay()
        self.replays += 1
        return self.logits[:n]

