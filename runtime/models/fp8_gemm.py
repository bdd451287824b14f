"""The block-FP8 GEMM for CUDA (Triton): y = dequant(x) @ dequant(w).T for fp8 activations and
weights whose scales cover groups of `group` columns (DeepSeek-V3-style w8a8 block GEMMs).

Operands, as fp8_linear.py prepares them:
  a   [M, K] float8_e4m3fn  activations, quantized per row per group of `group` columns
  a_s [M, G] float32        a's scales, G = ceil(K / group): a[m, k] stands for a * a_s[m, k // group]
  b   [N, K] float8_e4m3fn  the weight, rows = output features (the checkpoint's layout)
  b_s [N, G] float32        b's scales per row per group: a checkpoint's 128x128 block scale is
                            repeated on each of its block's rows (fp8.py), so rows may be sliced
                            and concatenated anywhere
Each program computes a [BLOCK_M, BLOCK_N] tile of y, walking K one group at a time: one fp8 dot
of the group's columns accumulated in float32, times the outer product of the two scale
vectors. K and N need not be multiples of the block: the last group and tiles are masked.

fp8 `tl.dot` needs sm_89 or later (an L4, an H100); the engine uses this kernel only there.
tests/models/test_fp8_gemm.py checks it under TRITON_INTERPRET=1 on the CPU; the compile check
(tests/attention/triton_offline.py) builds it for sm_89 and sm_90.
"""

from __future__ import annotations

import torch

from runtime.triton_launch import Launch, check_rows

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK_N = 128

# fmt: off
if triton is not None:

    @triton.jit
    def _block_fp8_gemm_kernel(  # type: ignore[no-untyped-def]
        A, AS, B, BS, C, M, N, K, stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # of a and y
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # of y: rows of b
        row_ok, col_ok = rows < M, cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(0, tl.cdiv(K, GROUP)):
            ks = g * GROUP + tl.arange(0, GROUP)
            k_ok = ks < K
            a = tl.load(A + rows[:, None] * stride_am + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, GROUP]
            b = tl.load(B + cols[None, :] * stride_bn + ks[:, None],
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # [GROUP, BLOCK_N]
            a_s = tl.load(AS + rows * stride_asm + g, mask=row_ok, other=0.0)  # [BLOCK_M]
            b_s = tl.load(BS + cols * stride_bsn + g, mask=col_ok, other=0.0)  # [BLOCK_N]
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        tl.store(C + rows[:, None] * stride_cm + cols[None, :], acc.to(C.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])
# fmt: on


def block_m(rows: int) -> int:
    """The tile height for a step of `rows` rows: 16 for decode-sized steps (tl.dot's least),
    up to 64 for prefill."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def block_fp8_gemm_launch(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
                          group: int, out_dtype: torch.dtype) -> Launch:
    """The launch computing y [M, N] (out_dtype) = (a * a_s) @ (b * b_s).T, shapes as above."""
    check_rows(a, b)
    (m, k), n = a.shape, b.shape[0]
    groups = -(-k // group)
    if b.shape[1] != k or a_s.shape != (m, groups) or b_s.shape != (n, groups):
        raise ValueError(f"block fp8 GEMM operands do not match: a {tuple(a.shape)}, a_s "
                         f"{tuple(a_s.shape)}, b {tuple(b.shape)}, b_s {tuple(b_s.shape)}, "
                         f"group {group}")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    bm = block_m(m)
    return Launch(
        _block_fp8_gemm_kernel, (-(-m // bm), -(-n // BLOCK_N)),
        (a, a_s, b, b_s, out, m, n, k, a.stride(0), a_s.stride(0), b.stride(0), b_s.stride(0),
         out.stride(0)),
        {"GROUP": group, "BLOCK_M": bm, "BLOCK_N": BLOCK_N, "num_warps": 8 if bm == 64 else 4,
         "num_stages": 3},
        out,
    )
