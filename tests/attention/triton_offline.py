"""Compile our Triton kernels for NVIDIA GPUs on a machine that has none.

Triton's JIT compiles for whatever target its active driver names. `Offline` names one and does
nothing else, so `JITFunction.warmup` runs the JIT's own path on the launches the engine builds
(attention's paged_decode, paged_extend, with and without a sliding window, over fp8 KV pages
for sm_89/sm_90, and store_kv, the model's fused ops, the block-FP8 GEMM for sm_89/sm_90): the
same
specialization (argument types, 16-byte divisibility), lowering, and ptxas to a cubin, which is
what a GPU would then load. The bundled cuobjdump reads the cubin's registers and local memory
(spills).

Prints one JSON object per compiled kernel. Run by tests/attention/test_triton_compile.py in a
subprocess: the kernels must be JIT functions, not the interpreter's (TRITON_INTERPRET unset).
By hand, with another triton: PYTHONPATH=DIR python -m tests.attention.triton_offline.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from runtime.attention.triton_backend import paged_decode, paged_extend, store_kv
from runtime.kvcache.fp8 import KVScales
from runtime.kvcache.pool import KVPool
from runtime.kvcache.req_to_token import ReqToTokenPool
from runtime.models.fp8_gemm import block_fp8_gemm_launch
from runtime.models.fused import add_rms_norm_launch, rope_launch, silu_mul_launch
from runtime.models.rope import RotaryEmbedding
from runtime.triton_launch import Launch

# (name, query heads, KV heads, head_dim, max context, hidden, intermediate): shapes baton serves
SHAPES = [
    ("smollm2-135m", 9, 3, 64, 8192, 576, 1536),  # the builtin model
    ("llama-1b", 32, 8, 64, 8192, 2048, 8192),  # bench/gpu.py's 1B shape
    ("llama-8b", 32, 8, 128, 8192, 4096, 14336),
    ("phi-3-medium", 40, 10, 128, 4096, 5120, 17920),
    ("head-dim-96", 32, 32, 96, 4096, 3072, 8192),  # padded to 128 columns (e.g. Phi-3-mini)
]
KERNELS = ("decode", "extend", "decode-sliding", "extend-sliding", "store_kv", "add_rms_norm",
           "rope", "silu_mul")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# what to build: (GPU arch, dtype, shapes); sm_90 is an H100, sm_80 an A100, sm_89 an L4.
# Every shape in bf16 on sm_90 (what GPU pools serve); the smallest and the largest heads for
# the other dtypes and arches (each target compiles for itself, so each costs a real compile:
# the suite's time; fp32 with head_dim 128 is the most shared memory and registers a block takes)
EDGE_SHAPES = ["smollm2-135m", "llama-8b"]
PLAN = [(90, "bf16", [s[0] for s in SHAPES]), (90, "fp32", EDGE_SHAPES),
        (90, "fp16", EDGE_SHAPES), (80, "bf16", EDGE_SHAPES), (89, "bf16", EDGE_SHAPES)]
# the block-FP8 GEMM (fp8 dot: sm_89+), bf16 out, once per tile height (decode's 16 rows, 32,
# prefill's 64) on llama-8b's gate_up (K 4096, N 28672): its shapes only change the grid
FP8_GEMM = {"fp8_gemm-m16": 16, "fp8_gemm-m32": 32, "fp8_gemm-m64": 64}
FP8_PLAN = [90, 89]
# attention over fp8 KV pages (--kv-cache-dtype fp8_e4m3): e4m3 conversions need sm_89 or later
# (on sm_80 Triton refuses fp8e4nv: FP8_KV_REFUSED, and so does the backend, by name); a float32
# model's spill registers on sm_90 (stack 120 to 5080 bytes, triton 3.8), so the backend refuses
# those too and they are not built here
FP8_KV_KERNELS = ("decode-fp8kv", "extend-fp8kv")
FP8_KV_PLAN = [(90, ["bf16", "fp16"]), (89, ["bf16"])]
FP8_KV_SHAPES = ["smollm2-135m", "llama-8b"]
FP8_KV_REFUSED = 80


class Offline:
    """A triton driver that names a GPU target and has no GPU: enough for warmup to compile."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def launches(heads: int, kv_heads: int, head_dim: int, context: int, hidden: int, inter: int,
             dtype: torch.dtype) -> dict[str, Launch]:
    """Every kernel's launch on CPU tensors laid out as the engine lays them out: attention
    (decode, extend) and the fused ops between the matmuls (runtime/models/fused.py)."""
    pool = KVPool(1, 4, 16, kv_heads, head_dim, dtype)
    table = ReqToTokenPool(4, context).table
    rows = torch.zeros(2, dtype=torch.int64)
    q = torch.zeros(2, heads * head_dim, dtype=dtype).view(2, heads, head_dim)
    qkv = torch.zeros(2, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q_view, k_view, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    rope = RotaryEmbedding(head_dim, 16, 10000.0, None).to("cpu", dtype).lookup(rows)
    x = torch.zeros(2, hidden, dtype=dtype)
    return {
        "decode": paged_decode(pool, 0, q, table, rows, rows, 0.125),
        "extend": paged_extend(pool, 0, q, table, rows, rows, rows, rows, 1, 0.125),
        # a sliding-window layer's kernels (Gemma 3, Mistral): SLIDING compiles them apart
        "decode-sliding": paged_decode(pool, 0, q, table, rows, rows, 0.125, 512),
        "extend-sliding": paged_extend(pool, 0, q, table, rows, rows, rows, rows, 1, 0.125, 512),
        "store_kv": store_kv(pool, 0, rows, k_view.view(2, kv_heads, head_dim),
                             k_view.view(2, kv_heads, head_dim)),
        "add_rms_norm": add_rms_norm_launch(x, x, x[0], 1e-5),
        "rope": rope_launch(q_view.view(2, heads, head_dim), k_view.view(2, kv_heads, head_dim), rope),
        "silu_mul": silu_mul_launch(torch.zeros(2, 2 * inter, dtype=dtype)),
    }


def fp8_kv_launches(heads: int, kv_heads: int, head_dim: int, context: int, *_: int,
                    dtype: torch.dtype) -> dict[str, Launch]:
    """Decode and extend over an fp8 pool of a `dtype` model (scales as kernel arguments)."""
    pool = KVPool(1, 4, 16, kv_heads, head_dim, dtype, scales=KVScales((0.5,), (2.0,), "offline"))
    table = ReqToTokenPool(4, context).table
    rows = torch.zeros(2, dtype=torch.int64)
    q = torch.zeros(2, heads, head_dim, dtype=dtype)
    return {"decode-fp8kv": paged_decode(pool, 0, q, table, rows, rows, 0.125),
            "extend-fp8kv": paged_extend(pool, 0, q, table, rows, rows, rows, rows, 1, 0.125)}


def fp8_gemm_launches() -> dict[str, Launch]:
    k, n = 4096, 28672
    w, w_s = torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.zeros(n, k // 128)
    out = {}
    for name, m in FP8_GEMM.items():
        x, x_s = torch.zeros(m, k, dtype=torch.float8_e4m3fn), torch.zeros(m, k // 128)
        out[name] = block_fp8_gemm_launch(x, x_s, w, w_s, 128, torch.bfloat16)
    return out


def resources(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED (static) and LOCAL of the cubin's one function, from cuobjdump."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True,
                              check=True, timeout=60).stdout  # fmt: skip
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    return {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}


def main() -> None:
    shapes = {s[0]: s[1:] for s in SHAPES}
    for arch, dtype, names in PLAN:
        driver.set_active(Offline(arch))
        fresh: set[int] = set()
        for name in names:
            for kernel, launch in launches(*shapes[name], DTYPES[dtype]).items():
                _fresh(launch, fresh)
                report(arch, name, dtype, kernel, launch)
    for arch in FP8_PLAN:
        driver.set_active(Offline(arch))
        fresh = set()
        for kernel, launch in fp8_gemm_launches().items():
            _fresh(launch, fresh)
            report(arch, "llama-8b", "fp8", kernel, launch)
    for arch, dtypes in FP8_KV_PLAN:
        driver.set_active(Offline(arch))
        fresh = set()
        for name in FP8_KV_SHAPES:
            for dtype in dtypes:
                for kernel, launch in fp8_kv_launches(*shapes[name], dtype=DTYPES[dtype]).items():
                    _fresh(launch, fresh)
                    report(arch, name, dtype, kernel, launch)
    refused(FP8_KV_REFUSED, fp8_kv_launches(*shapes["smollm2-135m"], dtype=torch.bfloat16))
    print(json.dumps({"triton": triton.__version__}), file=sys.stderr)


def _fresh(launch: Launch, cleared: set[int]) -> None:
    """Forget what the kernel compiled for the previous target: a JIT function keeps its
    compiled kernels per device id (`device_caches`), and Offline's device is always 0, so
    without this every later target would get the first one's cubin back."""
    if id(launch.kernel) not in cleared:
        launch.kernel.device_caches.clear()
        cleared.add(id(launch.kernel))


# immediates (PTX hex) of -0.0, and of 1.0 and -1.0, in bf16, fp16 and f32
NEG_ZERO = {"0x8000", "0f80000000"}
ONES = {"0x3F80", "0xBF80", "0x3C00", "0xBC00", "0f3F800000", "0fBF800000"}


def fused_fmas(ptx: str) -> int:
    """The fma instructions in `ptx` that fuse a product into a sum: not those that stand for
    one operation rounded once, fma(a, b, -0) for a*b and fma(a, ±1, c) for c ± a (how sm_80 and
    sm_89, which have no bf16 mul or add, compute bf16 products and sums)."""
    consts = dict(re.findall(r"mov\.b(?:16|32)\s+(%\w+),\s*(0[xf][0-9A-Fa-f]+);", ptx))
    fused = 0
    for a, b, c in re.findall(r"\bfma\.\S+\s+%\w+,\s*(%?\w+),\s*(%?\w+),\s*(%?\w+);", ptx):
        a, b, c = (consts.get(x, x) for x in (a, b, c))
        if c not in NEG_ZERO and a not in ONES and b not in ONES:
            fused += 1
    return fused


def report(arch: int, shape: str, dtype: str, kernel: str, launch: Launch) -> None:
    """Compile one launch for `arch` and print what the cubin needs, as one JSON line."""
    compiled: Any = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.constants)
    row = {"arch": arch, "shape": shape, "dtype": dtype, "kernel": kernel,
           "cubin_bytes": len(compiled.asm["cubin"]),
           "dynamic_shared": compiled.metadata.shared,
           "fma": fused_fmas(compiled.asm["ptx"]),
           **resources(compiled.asm["cubin"])}  # fmt: skip
    print(json.dumps(row), flush=True)


def refused(arch: int, launches: dict[str, Launch]) -> None:
    """Compile the decode launch for `arch`, expecting triton to refuse it: one JSON line with
    why (the last line of its error), or with none if it compiled."""
    driver.set_active(Offline(arch))
    launch = launches["decode-fp8kv"]
    launch.kernel.device_caches.clear()
    try:
        launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.constants)
        why = None
    except Exception as e:  # triton's CompilationError wraps the frontend's error
        why = str(e).strip().splitlines()[-1]
    print(json.dumps({"arch": arch, "kernel": "decode-fp8kv", "refused": why}), flush=True)


if __name__ == "__main__":
    main()
