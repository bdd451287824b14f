"""The native CPU decode kernel (backend "cpu") against plain torch attention (backend "torch").

Both run through the AttentionBackend interface on a real paged pool whose pages are handed out
in shuffled order, so each request's slots are scattered the way they are after churn; float32
pages, and fp8 pages (--kv-cache-dtype fp8_e4m3) under a different scale in every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from runtime.attention.base import BackendUnavailable
from runtime.attention.cpu_backend import CpuAttention
from runtime.attention.registry import create_attention_backend
from runtime.attention.torch_backend import TorchAttention
from runtime.forward_batch import ForwardBatch
from runtime.kvcache.allocator import PageAllocator
from runtime.kvcache.fp8 import KVScales
from runtime.kvcache.manager import KVCacheManager, KVSlots
from runtime.kvcache.pool import KVPool
from runtime.kvcache.req_to_token import ReqToTokenPool

LAYER = 1  # a middle layer of a 3-layer pool: pages are strided past the other layers
# an fp8 pool's: K and V apart, and each layer its own (a kernel reading another's is off)
FP8_SCALES = KVScales((0.5, 3.0, 0.25), (2.0, 0.125, 4.0), "test")


@dataclass
class Holder:  # what KVCacheManager needs of a request
    kv: KVSlots = field(default_factory=KVSlots)


def decode_setup(
    seq_lens: list[int], heads: int, kv_heads: int, head_dim: int, page_size: int = 4, seed: int = 0,
    scales: KVScales | None = None,
) -> tuple[KVPool, ReqToTokenPool, ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool filled with random K/V (fp8 bytes under `scales`, if given), requests of
    `seq_lens` on shuffled pages, one decode batch."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 3
    pool = KVPool(3, num_pages, page_size, kv_heads, head_dim, torch.float32, scales=scales)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g).to(pool.dtype))
    allocator = PageAllocator(num_pages, page_size)
    everything = allocator.alloc(num_pages)  # hand all pages back in random order: scattered
    allocator.free([everything[i] for i in torch.randperm(num_pages, generator=g).tolist()])
    table = ReqToTokenPool(len(seq_lens), max(seq_lens) + 8, "cpu")
    kv = KVCacheManager(allocator, table)
    holders = [Holder() for _ in seq_lens]
    for h, n in zip(holders, seq_lens, strict=True):
        kv.grow(h, n - 1)  # the prefix; the decode token takes the last slot below
    out_loc = kv.grow_one_each(holders)  # type: ignore[arg-type]
    b = len(seq_lens)
    batch = ForwardBatch(
        mode="decode",
        input_ids=torch.zeros(b, dtype=torch.int64),
        positions=torch.tensor([n - 1 for n in seq_lens]),
        out_cache_loc=out_loc,
        req_pool_indices=torch.tensor([h.kv.row for h in holders]),
        seq_lens=list(seq_lens),
        extend_lens=[1] * b,
        seq_lens_t=torch.tensor(seq_lens),
        extend_lens_t=torch.ones(b, dtype=torch.int64),
        sampling=None,  # type: ignore[arg-type]
    )
    q = torch.randn(b, heads, head_dim, generator=g)
    k = torch.randn(b, kv_heads, head_dim, generator=g)
    v = torch.randn(b, kv_heads, head_dim, generator=g)
    return pool, table, batch, q, k, v


def run(backend: str, pool: KVPool, table: ReqToTokenPool, batch: ForwardBatch,
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """LAYER's attention; with `window`, LAYER slides and the layers beside it do not."""
    attn = create_attention_backend(backend, pool, table, q.shape[-1] ** -0.5,
                                    (None, window, None))
    attn.begin(batch)
    return attn.forward(LAYER, q, k, v, batch)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(9, 3, 64), (4, 4, 64), (8, 2, 128), (4, 1, 32), (32, 2, 96)],
    ids=["smollm2-gqa3", "mha", "gqa4-d128", "mqa-d32", "gqa16-d96"],
)
def test_native_decode_equals_torch(heads: int, kv_heads: int, head_dim: int) -> None:
    # lengths: 1 (only the new token), page-aligned, off by one either side, long
    seq_lens = [1, 4, 5, 7, 8, 33, 130, 301]
    pool, table, batch, q, k, v = decode_setup(seq_lens, heads, kv_heads, head_dim)
    want = run("torch", pool, table, batch, q, k, v)
    got = run("cpu", pool, table, batch, q, k, v)
    assert got.shape == (len(seq_lens), heads * head_dim)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(9, 3, 64), (8, 2, 128), (4, 1, 32), (32, 1, 64)],
    ids=["smollm2-gqa3", "gqa4-d128", "mqa-d32", "gqa32-torch-fallback"],
)
def test_native_decode_of_fp8_pages_equals_torch_and_float64(heads: int, kv_heads: int,
                                                             head_dim: int) -> None:
    """fp8 pages read through the layer's scales: the torch backend's output on the same pool
    (and the new token written through fp8, as the pool stores it), both at float64's."""
    seq_lens = [1, 4, 5, 33, 130]
    pool, table, batch, q, k, v = decode_setup(seq_lens, heads, kv_heads, head_dim,
                                               scales=FP8_SCALES)
    want = run("torch", pool, table, batch, q, k, v)
    got = run("cpu", pool, table, batch, q, k, v)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    k8, v8 = pool.as_stored(LAYER, k, v)  # the new token as the pool holds it
    torch.testing.assert_close(got.double(), reference64(pool, table, batch, q, k8, v8),
                               atol=2e-6, rtol=1e-5)


def reference64(pool: KVPool, table: ReqToTokenPool, batch: ForwardBatch, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Decode attention in float64, request by request, straight from the definition (over the
    last `window` positions with a window)."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for i, n in enumerate(batch.seq_lens):
        slots = table.table[int(batch.req_pool_indices[i]), :n]
        keys, values = (t.double() for t in pool.read(LAYER, pool.locate(slots)))  # [n, KVH, D]
        keys[-1], values[-1] = k[i], v[i]  # the new token's own K/V
        keys, values = keys[-(window or n):], values[-(window or n):]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        weights = (torch.einsum("hd,nhd->hn", q[i].double(), keys) * q.shape[-1] ** -0.5).softmax(-1)
        outs.append(torch.einsum("hn,nhd->hd", weights, values).reshape(-1))
    return torch.stack(outs)


@pytest.mark.parametrize("sharpness", [0.01, 1.0, 30.0], ids=["flat", "normal", "peaked"])
def test_native_softmax_is_as_accurate_as_torch(sharpness: float) -> None:
    """Near-uniform weights, and scores hundreds apart (exp underflows for most positions).

    Peaked scores amplify any fp32 rounding in the dot products, so both backends are measured
    against float64 and the kernel may not be worse than torch's SDPA.
    """
    pool, table, batch, q, k, v = decode_setup([2, 17, 64, 257], 9, 3, 64, seed=3)
    q = q * sharpness
    want = reference64(pool, table, batch, q, k, v)
    err = {b: (run(b, pool, table, batch, q, k, v).double() - want).abs().max().item()
           for b in ("torch", "cpu")}
    assert err["cpu"] <= max(1.5 * err["torch"], 2e-6), err


@pytest.mark.parametrize("window", [1, 5, 16])
def test_a_sliding_window_decodes_as_float64_in_both_backends(window: int) -> None:
    """A window of only the new token, one across pages, one a page-multiple: both backends
    attend to each request's last `window` positions, equal to the float64 definition; the
    layers beside it stay global."""
    seq_lens = [1, 4, 5, 7, 8, 17, 33, 130]
    pool, table, batch, q, k, v = decode_setup(seq_lens, 8, 2, 64)
    want = reference64(pool, table, batch, q, k, v, window)
    for backend in ("torch", "cpu"):
        got = run(backend, pool, table, batch, q, k, v, window)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    attn = create_attention_backend("cpu", pool, table, 0.125, (None, window, None))
    assert (attn.window(0), attn.window(LAYER), attn.window(7)) == (None, window, None)


@pytest.mark.parametrize("scales", [None, FP8_SCALES], ids=["float32", "fp8"])
def test_native_decode_reads_only_its_own_slots(scales: KVScales | None) -> None:
    """Poison every slot past each request's length: the output must not move."""
    pool, table, batch, q, k, v = decode_setup([3, 17, 40], 9, 3, 64, scales=scales)
    before = run("cpu", pool, table, batch, q, k, v)
    used = torch.cat([table.table[i, :n] for i, n in enumerate(batch.seq_lens)])
    unused = torch.ones(pool.num_slots, dtype=torch.bool)
    unused[used] = False
    k_pages, v_pages = pool.pages(LAYER)
    at = pool.locate(unused.nonzero().squeeze(1))
    k_pages[at] = 1e4
    v_pages[at] = float("nan")
    torch.testing.assert_close(run("cpu", pool, table, batch, q, k, v), before)


def test_kernel_rejects_bad_input_instead_of_reading_out_of_bounds() -> None:
    pool, table, batch, q, _, _ = decode_setup([5, 9], 9, 3, 64)
    attn = create_attention_backend("cpu", pool, table, 0.125)
    assert isinstance(attn, CpuAttention)
    attn.begin(batch)
    out = torch.empty_like(q)
    lens = attn.seq_lens.clone()
    k_pages, v_pages = pool.pages(LAYER)
    for bad in (pool.num_slots, -1):  # one past the end of the pool, one before it
        rows = attn.row_table.clone()
        rows[1, 2] = pool.row_offsets(torch.tensor(bad))
        with pytest.raises(RuntimeError, match="row out of range"):
            attn.op(q, k_pages, v_pages, rows, lens, 0.125, out)
    with pytest.raises(RuntimeError, match="bad seq_len"):
        attn.op(q, k_pages, v_pages, attn.row_table, lens * 100, 0.125, out)
    with pytest.raises(RuntimeError, match="float32"):
        attn.op(q.double(), k_pages, v_pages, attn.row_table, lens, 0.125, out)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        attn.op(q, k_pages.transpose(1, 2), v_pages.transpose(1, 2), attn.row_table, lens, 0.125, out)


@pytest.mark.parametrize("scales", [None, FP8_SCALES], ids=["float32", "fp8"])
def test_auto_picks_the_native_kernel_on_cpu_float32(scales: KVScales | None) -> None:
    """g++ is on every machine this project runs its suite on: the fast path must really build,
    for float32 pages and fp8 ones."""
    pool, table, *_ = decode_setup([4], 9, 3, 64, scales=scales)
    assert isinstance(create_attention_backend("auto", pool, table, 0.125), CpuAttention)


def test_cpu_backend_refuses_what_it_cannot_run_and_auto_falls_back() -> None:
    bf16 = KVPool(1, 4, 4, 3, 64, torch.bfloat16)
    odd = KVPool(1, 4, 4, 3, 48, torch.float32)
    table = ReqToTokenPool(1, 16, "cpu")
    for pool in (bf16, odd):
        with pytest.raises(BackendUnavailable):
            create_attention_backend("cpu", pool, table, 0.125)
        attn = create_attention_backend("auto", pool, table, 0.125)
        assert type(attn) is TorchAttention


def test_a_build_lock_left_by_a_killed_build_is_removed(tmp_path: Path) -> None:
    """torch waits for a build's lock file without a limit: one a killed build left behind
    (older than STALE_LOCK_S) is removed, a fresh one (a build under way) is kept."""
    import os
    import time

    from runtime.attention.native import STALE_LOCK_S, clear_stale_lock

    lock = tmp_path / "lock"
    assert not clear_stale_lock(lock)  # none
    lock.touch()
    assert not clear_stale_lock(lock) and lock.exists()  # a build under way
    old = time.time() - STALE_LOCK_S - 10
    os.utime(lock, (old, old))
    assert clear_stale_lock(lock) and not lock.exists()
