"""Our Triton kernels (attention, and the model's fused ops between the matmuls) compile to GPU
machine code, here, on a machine without a GPU.

test_triton_kernels.py and tests/models/test_fused.py check what the kernels compute, in the
interpreter; this checks what only the compiler sees: that triton lowers them, with the
arguments the engine passes, to a cubin for an H100 (sm_90: every shape in bf16, the smallest and
largest heads in fp32 and fp16), an A100 (sm_80) and an L4 (sm_89) (the block-FP8 GEMM and attention over fp8 KV pages for sm_90 and sm_89 only: fp8
needs sm_89, and sm_80 is refused), within the GPU's shared memory per block and without
spilling registers to local
memory (tests/attention/triton_offline.py does the compiling, in a subprocess: the kernels there
must not be the interpreter's).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)
ROOT = Path(__file__).resolve().parents[2]
SHARED_PER_BLOCK = {90: 232448, 89: 101376, 80: 166912}  # bytes, opt-in maximum (CUDA guide)


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))  # compile for real
    done = subprocess.run(
        [sys.executable, "-m", "tests.attention.triton_offline"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.fixture(scope="module")
def compiled(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The kernels compiled (not the refused compile)."""
    return [r for r in rows if "refused" not in r]


def test_every_kernel_compiles_for_every_target(compiled: list[dict[str, Any]]) -> None:
    from tests.attention import triton_offline as plan

    want = {(arch, shape, dtype, kernel) for arch, dtype, shapes in plan.PLAN
            for shape in shapes for kernel in plan.KERNELS}
    want |= {(arch, "llama-8b", "fp8", kernel) for arch in plan.FP8_PLAN for kernel in plan.FP8_GEMM}
    want |= {(arch, shape, dtype, kernel) for arch, dtypes in plan.FP8_KV_PLAN
             for shape in plan.FP8_KV_SHAPES for dtype in dtypes for kernel in plan.FP8_KV_KERNELS}
    got = {(r["arch"], r["shape"], r["dtype"], r["kernel"]) for r in compiled}
    assert got == want
    assert {arch for arch, _, _ in plan.PLAN} == set(SHARED_PER_BLOCK)
    assert all(r["cubin_bytes"] > 0 for r in compiled)


def test_kernels_fit_in_shared_memory_and_registers(compiled: list[dict[str, Any]]) -> None:
    for r in compiled:
        assert r["dynamic_shared"] + r["shared"] <= SHARED_PER_BLOCK[r["arch"]], r
        # stack or local memory means ptxas spilled registers: a slow kernel
        assert r["stack"] == 0 and r["local"] == 0, r


def test_fp8_kv_attention_is_refused_on_sm80_as_the_backend_refuses_it(
        rows: list[dict[str, Any]]) -> None:
    """Triton has no e4m3 conversion before sm_89: TritonAttention.create refuses an fp8 pool
    there by name (auto then takes torch). If a triton compiles it one day, this says so."""
    (row,) = [r for r in rows if "refused" in r]
    assert row["arch"] == 80 and "fp8e4nv not supported" in str(row["refused"]), row


def test_rope_rounds_each_product_as_torch_does(compiled: list[dict[str, Any]]) -> None:
    """RoPE is bit-exact with torch's x*cos + rotate_half(x)*sin only if each product is rounded
    before the sum: no fused multiply-add in its PTX (triton contracts one by default: on an H100
    that left 15-22% of outputs an ulp off torch's, float32 and bf16). sm_80 and sm_89 have no
    bf16 mul or add: their fma(a, b, -0) and fma(a, ±1, c) are those, rounded once, not fused
    (`triton_offline.fused_fmas`)."""
    rope = [r for r in compiled if r["kernel"] == "rope"]
    assert {r["arch"] for r in rope} == {80, 89, 90}
    assert all(r["fma"] == 0 for r in rope), [r for r in rope if r["fma"]]


def test_a_fused_fma_is_told_from_a_bf16_mul_or_add() -> None:
    from tests.attention.triton_offline import fused_fmas

    sm80 = """mov.b16 %rs10, 0x8000;
    mov.b16 %rs16, 0x3F80;
    fma.rn.bf16 %rs11, %rs1, %rs4, %rs10;
    fma.rn.bf16 %rs9, %rs13, %rs16, %rs14;"""
    assert fused_fmas(sm80) == 0
    assert fused_fmas(sm80 + "\nfma.rn.bf16 %rs8, %rs12, %rs15, %rs11;") == 1
    assert fused_fmas("fma.rn.f32 %r3, %r1, %r2, %r0;") == 1


def test_each_target_is_compiled_for_itself(compiled: list[dict[str, Any]]) -> None:
    """A JIT function keeps its compiled kernels per device id: each target must get its own
    cubin, not the first target's back (sm_80's and sm_90's cubins of one kernel differ)."""
    cubins = {(r["arch"], r["shape"], r["kernel"]): r["cubin_bytes"] for r in compiled
              if r["dtype"] == "bf16"}
    assert any(cubins[(80, s, k)] != cubins[(90, s, k)] for (a, s, k) in cubins if a == 80)
