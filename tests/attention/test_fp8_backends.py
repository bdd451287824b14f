"""Every attention backend reads an fp8 pool (--kv-cache-dtype fp8_e4m3) as the torch backend
does: an extend with and without a cached prefix, then a decode, on a pool of random fp8 bytes
under a K and a V scale of their own in each layer. Each backend's outputs equal the torch
backend's to float tolerance, and the bytes it wrote for the new tokens equal torch's (one
quantization rule, whoever writes). cpu is the native kernel, triton its kernels (the Triton
interpreter on the CPU), flashinfer baton's backend over the torch stand-in for flashinfer's
wrappers (tests/attention/flashinfer_standin.py: it asserts the planned q and kv dtypes, and
reads the pages under the k_scale and v_scale run() is given); flashinfer itself: tests/gpu.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported: its kernels in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from runtime.attention.base import AttentionBackend
from runtime.attention.registry import create_attention_backend
from runtime.forward_batch import ForwardBatch
from runtime.kvcache.allocator import PageAllocator
from runtime.kvcache.fp8 import FP8, KVScales
from runtime.kvcache.manager import KVCacheManager, KVSlots
from runtime.kvcache.pool import KVPool
from runtime.kvcache.req_to_token import ReqToTokenPool

SCALES = KVScales((0.5, 3.0, 0.25), (2.0, 0.125, 4.0), "test")  # each layer its own
HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 32, 4
PAIRS = [(0, 9), (13, 5), (37, 1)]  # (cached prefix, new tokens) of each request's extend
SCALE = HEAD_DIM**-0.5


@dataclass
class Holder:  # what KVCacheManager needs of a request
    kv: KVSlots = field(default_factory=KVSlots)


@dataclass(frozen=True)
class Outputs:
    extended: torch.Tensor  # [new tokens, H * D] of the extend, in layer 1
    decoded: torch.Tensor  # [requests, H * D] of the decode after it, in layer 2
    pool: KVPool  # afterwards


def batch(mode: str, out_loc: torch.Tensor, rows: list[int], lens: list[int], new: list[int],
          device: torch.device) -> ForwardBatch:
    def t(x: list[int] | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(x, dtype=torch.int64).to(device)

    return ForwardBatch(
        mode=mode,  # type: ignore[arg-type]
        input_ids=t(torch.zeros(sum(new))),
        positions=t(torch.cat([torch.arange(n - e, n) for n, e in zip(lens, new, strict=True)])),
        out_cache_loc=t(out_loc), req_pool_indices=t(rows), seq_lens=lens, extend_lens=new,
        seq_lens_t=t(lens), extend_lens_t=t(new), sampling=None,  # type: ignore[arg-type]
    )  # fmt: skip


def run(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Outputs:
    """Backend `name` over the same fp8 pool and batches whatever the backend: every slot is
    handed out on the host first (shuffled pages), then the table goes to `device`."""
    g = torch.Generator().manual_seed(0)
    num_pages = 40
    pool = KVPool(3, num_pages, PAGE, KV_HEADS, HEAD_DIM, dtype, device, SCALES)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g).to(FP8))
    allocator = PageAllocator(num_pages, PAGE)
    everything = allocator.alloc(num_pages)  # handed back shuffled: scattered pages
    allocator.free([everything[i] for i in torch.randperm(num_pages, generator=g).tolist()])
    kv = KVCacheManager(allocator, ReqToTokenPool(len(PAIRS), 64, "cpu"))
    holders = [Holder() for _ in PAIRS]
    for h, (prefix, _) in zip(holders, PAIRS, strict=True):
        kv.grow(h, prefix)  # the cached prefix: random fp8 bytes already in the pool
    new = [n for _, n in PAIRS]
    extend_loc = torch.cat([kv.grow(h, h.kv.length + n) for h, n in zip(holders, new, strict=True)])
    lens = [h.kv.length for h in holders]
    decode_loc = kv.grow_one_each(holders)  # type: ignore[arg-type]
    table = ReqToTokenPool(len(PAIRS), 64, device)
    table.table.copy_(kv.req_to_token.table)
    rows, dev = [h.kv.row for h in holders], pool.device
    attn: AttentionBackend = create_attention_backend(name, pool, table, SCALE)
    out = []
    for layer, b in ((1, batch("extend", extend_loc, rows, lens, new, dev)),
                     (2, batch("decode", decode_loc, rows, [n + 1 for n in lens], [1] * len(rows), dev))):
        q, k, v = (torch.randn(sum(b.extend_lens), heads, HEAD_DIM, generator=g).to(dev, dtype)
                   for heads in (HEADS, KV_HEADS, KV_HEADS))
        attn.begin(b)
        out.append(attn.forward(layer, q, k, v, b))
    return Outputs(out[0], out[1], pool)


@pytest.fixture(scope="module")
def torch_run() -> Outputs:
    return run("torch")


BACKENDS = [
    "cpu",
    pytest.param("triton", marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                                    reason="triton is not installed")),
    "flashinfer",
]


@pytest.mark.parametrize("name", BACKENDS)
def test_each_backend_reads_and_writes_fp8_pages_as_torch_does(
        name: str, torch_run: Outputs, monkeypatch: pytest.MonkeyPatch) -> None:
    if name == "flashinfer":  # flashinfer needs CUDA: its wrappers' stand-in, baton's backend
        from runtime.attention.registry import _REGISTRY

        monkeypatch.setitem(_REGISTRY, "flashinfer", "tests.attention.flashinfer_standin:backend")
    got = run(name)
    torch.testing.assert_close(got.extended, torch_run.extended, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got.decoded, torch_run.decoded, atol=2e-5, rtol=1e-4)
    assert torch.equal(got.pool.buffer.view(torch.uint8), torch_run.pool.buffer.view(torch.uint8))
