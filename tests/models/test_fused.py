"""The fused Triton ops (runtime/models/fused.py) against the torch ops they replace.

On CPU they run under TRITON_INTERPRET=1 (set below, before triton is imported); on a GPU,
compiled. The kernels round every intermediate as torch does, so RoPE and the residual add are
bit-exact; RMSNorm's sum and SiLU's exp may differ in the last float32 bits, so those outputs
are held to two ulps of the dtype. The interpreter truncates float32 -> bf16 where a GPU rounds
to nearest even, several times per output, so in bf16 on the CPU only gross errors show (held
to 2**-5); the float32 cases carry the CPU's check, the GPU's the bf16 one.
tests/attention/test_triton_compile.py compiles the kernels for GPUs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from runtime.models.fused import TRITON_OPS
from runtime.models.llama import TORCH_OPS
from runtime.models.rope import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def close(ours: torch.Tensor, ref: torch.Tensor, ulps: int = 2) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if DEVICE == "cpu" and ref.dtype == torch.bfloat16:
        torch.testing.assert_close(ours, ref, rtol=2**-5, atol=2**-5)  # the interpreter's bf16
    else:
        eps = torch.finfo(ref.dtype).eps
        torch.testing.assert_close(ours, ref, rtol=ulps * eps, atol=ulps * eps)


def exact(ours: torch.Tensor, ref: torch.Tensor) -> None:
    close(ours, ref, ulps=0)


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype: torch.dtype) -> None:
    x, delta = randn(5, 576, dtype=dtype, seed=1), randn(5, 576, dtype=dtype, seed=2)
    weight = randn(576, dtype=dtype, seed=3)
    out, res = TRITON_OPS.add_rms_norm(x, delta, weight, 1e-5)
    ref_out, ref_res = TORCH_OPS.add_rms_norm(x, delta, weight, 1e-5)
    exact(res, ref_res)
    close(out, ref_out)
    out, res = TRITON_OPS.add_rms_norm(x[::2], None, weight, 1e-5)  # rows strided, no add
    assert res.data_ptr() == x.data_ptr()
    close(out, TORCH_OPS.add_rms_norm(x[::2], None, weight, 1e-5)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 96], ids=["dim64", "dim96-padded"])
def test_rope_qk_is_bit_exact(dtype: torch.dtype, dim: int) -> None:
    heads, kv_heads = 9, 3
    qkv = randn(6, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=4)  # the qkv matmul's output
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(6, heads, dim), k.view(6, kv_heads, dim)
    rope = RotaryEmbedding(dim, 512, 10000.0, None).to(DEVICE, dtype)
    cos_sin = rope.lookup(torch.tensor([0, 1, 2, 77, 300, 511], device=DEVICE))
    ours, ref = TRITON_OPS.rope_qk(q, k, cos_sin), TORCH_OPS.rope_qk(q, k, cos_sin)
    for a, b in zip(ours, ref, strict=True):
        assert a.is_contiguous()
        exact(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype) -> None:
    gate_up = randn(3, 2 * 1536, dtype=dtype, seed=5) * 4  # past SILU_BLOCK, into saturation
    close(TRITON_OPS.silu_mul(gate_up), TORCH_OPS.silu_mul(gate_up))


def test_engine_on_fused_ops_gives_the_torch_ops_tokens(tiny_path: Path) -> None:
    """The whole forward on the fused ops (what CUDA runs): the same greedy tokens, with chunked
    prefill, decode and logits of selected rows."""
    from runtime import Engine

    prompts = ["The capital of France is", "1, 2, 3,", "Once upon a time, in a land far away"]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    outputs = []
    for ops in (TORCH_OPS, TRITON_OPS):
        engine = Engine(model=str(tiny_path), linear_backend="torch", attention_backend="torch",
                        chunked_prefill_size=8, device=DEVICE, dtype="float32")
        try:
            engine.runner.model.ops = ops
            outputs.append([r["output_ids"] for r in engine.generate(prompts, params)])
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1]
