"""Triton paged attention (runtime/attention/triton_backend.py) against a float64 reference.

On a GPU the kernels run compiled; on CPU they run under TRITON_INTERPRET=1 on tiny shapes (set
below, before triton is imported). The dev install pins triton 3.8.0 for this (3.6's interpreter
fails on numpy 2.4); skipped where triton is not installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from runtime.attention.triton_backend import paged_decode, paged_extend, store_kv
from runtime.kvcache.fp8 import KVScales
from runtime.kvcache.pool import KVPool
from tests.attention.reference import causal_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}  # ||out-ref||/||ref||


# an fp8 pool's (--kv-cache-dtype fp8_e4m3): K and V apart, each layer its own
FP8_SCALES = KVScales((0.5, 3.0, 0.25), (2.0, 0.125, 4.0), "test")


def setup(dtype: torch.dtype, lens: list[int], page_size: int, heads: int = 9,
          kv_heads: int = 3, head_dim: int = 32,
          scales: KVScales | None = None) -> tuple[KVPool, torch.Tensor, torch.Tensor]:
    """A 3-layer pool of random K/V (fp8 under `scales`, if given) and a req->token table whose
    rows (requests 2, 0, 3, ...: not in batch order) hold scattered slots; every slot no row
    holds is NaN."""
    gen = torch.Generator().manual_seed(sum(lens) + page_size)
    num_pages = sum(-(-n // page_size) for n in lens) + 7
    pool = KVPool(3, num_pages, page_size, kv_heads, head_dim, dtype, DEVICE, scales)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen).to(pool.dtype))
    table = torch.zeros((len(lens) + 2, max(lens) + 5), dtype=torch.int64)
    pages = torch.randperm(num_pages, generator=gen).tolist()
    rows = torch.randperm(len(lens) + 2, generator=gen)[: len(lens)]
    owned = torch.zeros(num_pages * page_size, dtype=torch.bool)
    for row, n in zip(rows.tolist(), lens, strict=True):
        mine = [pages.pop() for _ in range(-(-n // page_size))]
        table[row, :n] = torch.tensor([mine[i // page_size] * page_size + i % page_size
                                       for i in range(n)])
        owned[table[row, :n]] = True
    free = pool.locate(torch.nonzero(~owned).flatten().to(DEVICE))
    nan = torch.full((len(free[0]), kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    for layer in range(pool.num_layers):  # a kernel that reads a slot no request owns reads NaN
        pool.write(layer, free, nan, nan)
    return pool, table.to(DEVICE), rows.to(DEVICE)


def reference(pool: KVPool, layer: int, q: torch.Tensor, slots: torch.Tensor,
              query_pos: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """float64 attention of q [n, H, D] (at positions query_pos [n]) over the keys at `slots`
    (positions 0..len-1), causal (within the last `window` positions)."""
    k, v = pool.read(layer, pool.locate(slots))
    return causal_attention(q, k, v, query_pos, scale, window)


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = (out.double() - ref).norm() / ref.norm()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e} for {dtype}"


# the interpreter computes in numpy, which has no bfloat16 (it reads garbage): bf16 on GPU only
DTYPES = [torch.float32, torch.float16, *([torch.bfloat16] if DEVICE == "cuda" else [])]


STORE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # a copy: no arithmetic to get wrong


@pytest.mark.parametrize(("dtype", "scales"), [*((d, None) for d in STORE_DTYPES),
                                                (torch.float32, FP8_SCALES)])
@pytest.mark.parametrize(("page_size", "kv_heads", "head_dim"), [(1, 3, 32), (16, 2, 24), (4, 8, 64)])
def test_store_kv_writes_what_pool_write_writes(dtype: torch.dtype, scales: KVScales | None,
                                               page_size: int, kv_heads: int, head_dim: int) -> None:
    """k and v as the model hands them over (views into one qkv row per token), at scattered
    slots of one layer: the pool afterwards is byte for byte KVPool.write's, other layers
    untouched; an fp8 pool's bytes quantized under that layer's scales."""
    gen = torch.Generator().manual_seed(page_size + head_dim)
    pools = [KVPool(3, 9, page_size, kv_heads, head_dim, dtype, DEVICE, scales) for _ in range(2)]
    for pool in pools:
        pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen).to(pool.dtype))
    pools[1].buffer.copy_(pools[0].buffer)
    slots = torch.randperm(9 * page_size, generator=gen)[:7].to(DEVICE)
    width = kv_heads * head_dim
    qkv = torch.randn(7, 4 * width, generator=gen).to(dtype).to(DEVICE)
    k = qkv[:, 2 * width:3 * width].view(7, kv_heads, head_dim)
    v = qkv[:, 3 * width:].view(7, kv_heads, head_dim)
    store_kv(pools[0], 1, pools[0].row_offsets(slots), k, v).run()
    pools[1].write(1, pools[1].locate(slots), k, v)
    assert torch.equal(pools[0].buffer.view(torch.uint8), pools[1].buffer.view(torch.uint8))


# head dims: a power of two, and two the kernels pad (to 32 and 128 columns, masked)
HEAD_DIMS = [32, pytest.param(24, id="pad24"), pytest.param(80, id="pad80")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_paged_decode_matches_float64(dtype: torch.dtype, page_size: int, head_dim: int) -> None:
    lens = [1, 17, 64, 65, 130]  # one key; across page and 64-key block edges
    pool, table, rows = setup(dtype, lens, page_size, head_dim=head_dim)
    q = torch.randn(len(lens), 9, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    q = q.to(DEVICE)
    seq = torch.tensor(lens, device=DEVICE)
    out = paged_decode(pool, 1, q, table, rows, seq, 0.17).run()
    for b, n in enumerate(lens):
        slots = table[rows[b], :n]
        ref = reference(pool, 1, q[b : b + 1], slots, torch.tensor([n - 1], device=DEVICE), 0.17)
        close(out[b : b + 1], ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_paged_extend_matches_float64(dtype: torch.dtype, page_size: int, head_dim: int) -> None:
    # (prefix, new tokens): a fresh prompt, a cached prefix, one new token, more than BLOCK_M new
    pairs = [(0, 20), (37, 5), (64, 1), (3, 70)]
    lens = [p + n for p, n in pairs]
    pool, table, rows = setup(dtype, lens, page_size, head_dim=head_dim)
    total = sum(n for _, n in pairs)
    q = torch.randn(total, 9, head_dim, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    check_extend(pool, 2, q, table, rows, pairs, dtype)


def check_extend(pool: KVPool, layer: int, q: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                 pairs: list[tuple[int, int]], dtype: torch.dtype) -> None:
    """paged_extend of `q` (each request's new tokens, one after another) in `layer`, against
    float64 over what the pool reads, request by request ((prefix, new tokens) each)."""
    starts = [sum(n for _, n in pairs[:i]) for i in range(len(pairs))]
    out = paged_extend(
        pool, layer, q, table, rows, torch.tensor(starts, device=DEVICE),
        torch.tensor([n for _, n in pairs], device=DEVICE),
        torch.tensor([p for p, _ in pairs], device=DEVICE), max(n for _, n in pairs), 0.2).run()
    for i, (prefix, n) in enumerate(pairs):
        ref = reference(pool, layer, q[starts[i] : starts[i] + n], table[rows[i], : prefix + n],
                        torch.arange(prefix, prefix + n, device=DEVICE), 0.2)
        close(out[starts[i] : starts[i] + n], ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_pages_decode_and_extend_as_float64_of_what_the_pool_reads(dtype: torch.dtype) -> None:
    """fp8 pages under a K and a V scale of their own in each layer: both kernels attend to the
    values KVPool.read gives back (float64 over them is the reference): extend in layer 1,
    decode in layer 2."""
    pairs = [(0, 20), (37, 5), (3, 40)]  # (prefix, new tokens): fresh, cached prefix, > BLOCK_M
    lens = [p + n for p, n in pairs]
    pool, table, rows = setup(dtype, lens, 4, scales=FP8_SCALES)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(sum(n for _, n in pairs), 9, 32, generator=gen).to(dtype).to(DEVICE)
    dq = torch.randn(len(lens), 9, 32, generator=gen).to(dtype).to(DEVICE)
    check_extend(pool, 1, q, table, rows, pairs, dtype)
    out = paged_decode(pool, 2, dq, table, rows, torch.tensor(lens, device=DEVICE), 0.2).run()
    for b, n in enumerate(lens):
        ref = reference(pool, 2, dq[b : b + 1], table[rows[b], :n],
                        torch.tensor([n - 1], device=DEVICE), 0.2)
        close(out[b : b + 1], ref, dtype)


@pytest.mark.parametrize("window", [1, 20, 100])
def test_a_sliding_window_matches_float64(window: int) -> None:
    """Decode and extend with a window: of the new token alone, one that starts inside a key
    block and makes later queries of an extend program skip whole blocks (every key hidden from
    their rows), and one longer than some requests. The slots before each window are then set
    to NaN: a kernel that loads a key no query may see fails loudly, not by a little."""
    pairs = [(0, 20), (37, 5), (64, 1), (3, 70), (150, 40)]  # (prefix, new tokens)
    lens = [p + n for p, n in pairs]
    pool, table, rows = setup(torch.float32, lens, 4, head_dim=32)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(sum(n for _, n in pairs), 9, 32, generator=gen).to(DEVICE)
    dq = torch.randn(len(lens), 9, 32, generator=gen).to(DEVICE)
    starts = [sum(n for _, n in pairs[:i]) for i in range(len(pairs))]
    extend_refs = [reference(pool, 2, q[starts[i] : starts[i] + n], table[rows[i], : prefix + n],
                             torch.arange(prefix, prefix + n, device=DEVICE), 0.2, window)
                   for i, (prefix, n) in enumerate(pairs)]
    decode_refs = [reference(pool, 2, dq[b : b + 1], table[rows[b], :n],
                             torch.tensor([n - 1], device=DEVICE), 0.2, window)
                   for b, n in enumerate(lens)]
    for (prefix, _), r in zip(pairs, rows.tolist(), strict=True):  # hidden from every query
        old = pool.locate(table[r, : max(0, prefix - window + 1)])
        nan = torch.full((len(old[0]), 3, 32), float("nan"), device=DEVICE)
        pool.write(2, old, nan, nan)
    out = paged_extend(
        pool, 2, q, table, rows, torch.tensor(starts, device=DEVICE),
        torch.tensor([n for _, n in pairs], device=DEVICE),
        torch.tensor([p for p, _ in pairs], device=DEVICE), max(n for _, n in pairs), 0.2,
        window).run()
    for i, (_, n) in enumerate(pairs):
        close(out[starts[i] : starts[i] + n], extend_refs[i], torch.float32)
    out = paged_decode(pool, 2, dq, table, rows, torch.tensor(lens, device=DEVICE), 0.2, window).run()
    for b in range(len(lens)):
        close(out[b : b + 1], decode_refs[b], torch.float32)


def test_engine_on_triton_equals_torch_attention(tiny_path: Path) -> None:
    """Chunked prefill (so later chunks attend to a cached prefix), GQA and decode through the
    triton backend give the torch backend's greedy tokens, on the tiny random Llama."""
    from runtime import Engine
    from runtime.attention.triton_backend import TritonAttention

    prompts = ["The capital of France is", "Once upon a time, in a land far away, there lived a",
               "1, 2, 3,", "Hello"]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    outputs = {}
    for name in ("torch", "triton"):
        engine = Engine(model=str(tiny_path), attention_backend=name, linear_backend="torch",
                        chunked_prefill_size=8, page_size=4, device=DEVICE, dtype="float32")
        try:
            outputs[name] = [r["output_ids"] for r in engine.generate(prompts, params)]
            assert engine.runner.kv.is_all_free()
            assert (name == "triton") == isinstance(engine.runner.attn, TritonAttention)
        finally:
            engine.shutdown()
    assert outputs["triton"] == outputs["torch"]


def test_gemma3_on_triton_matches_hf_logits(model_files_path: Path, tmp_path: Path) -> None:
    """Gemma 3's sliding-window layer (a window of 8) beside its global one, through the
    triton kernels: chunked extend and decode give HF's logits."""
    from runtime.attention.triton_backend import TritonAttention
    from tests.models.test_forward_vs_hf import check_logits, hf_tiny

    path, hf = hf_tiny("gemma3-sliding", model_files_path, tmp_path)
    runner = check_logits(path, hf, "triton", "torch", DEVICE)
    assert isinstance(runner.attn, TritonAttention) and runner.attn.windows == (8, None)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_decode_graphs_on_triton_equal_eager_torch(family: str, tiny_path: Path,
                                                   model_files_path: Path, tmp_path: Path) -> None:
    """Decode graphs driven through the triton kernels (EagerGraph on the CPU: the same fixed
    buffers, padding rows reading the table's scratch row) give the eager torch backend's
    tokens, and padding writes nothing a request owns; Gemma 3's sliding-window layer (a
    window of 8, over prompts of 30 to 200 tokens) too."""
    from runtime.config import EngineConfig
    from runtime.engine.model_runner import ModelRunner
    from tests.engine.test_cuda_graph import CountedGraph, generate
    from tests.models.test_forward_vs_hf import hf_tiny

    path = tiny_path if family == "llama" else hf_tiny("gemma3-sliding", model_files_path, tmp_path)[0]

    def runner(attention: str) -> ModelRunner:
        config = EngineConfig(model=str(path), attention_backend=attention, page_size=4,
                              linear_backend="torch", device=DEVICE, max_total_tokens=2048,
                              dtype="float32")  # what `auto` gives on the CPU, not on CUDA
        return ModelRunner(config, max_running_requests=16)

    plain = runner("torch")
    eager = generate(plain, overlap=True)
    graphed = runner("triton")
    assert graphed.attn.cuda_graph_safe
    graphed.graphs = graphs = graphed.decode_graphs(8, CountedGraph)
    assert generate(graphed, overlap=True) == eager
    scratch = graphed.kv.allocator.num_pages
    assert torch.allclose(graphed.pool.buffer[:scratch], plain.pool.buffer[:scratch], atol=1e-5)
    assert all(g.replays for g in graphs.graphs.values())  # type: ignore[attr-defined]
