"""Triton kernels for the small ops between a layer's matmuls, for CUDA.

Eagerly, a Llama layer is ~40 kernels, most of them elementwise: RMSNorm alone is eight (cast,
square, mean, add, rsqrt, two multiplies, cast back), RoPE a dozen. A decode step at batch 1
runs nothing but such tiny kernels and weight reads, so their count, not their work, sets its
time, even inside a CUDA graph. Here each group is one kernel:
  add_rms_norm  the residual add and the next RMSNorm (the first layer's norm has no add)
  rope_qk       q's and k's rotation (HF's rotate_half layout) in one launch
  silu_mul      SiLU(gate) * up of the fused gate/up matmul's output
Every kernel reproduces the roundings of the torch ops it replaces (llama.py's TORCH_OPS): each
intermediate that torch stores in the model's dtype is rounded to that dtype here too, and the
math runs in float32 as torch's does (its "opmath"). What may still differ is the order of the
RMSNorm sum and float32 contractions: float32 noise.

`TRITON_OPS` is used by LlamaModel on CUDA when triton is installed; tests/models/test_fused.py
checks each kernel against the torch op under TRITON_INTERPRET=1 on the CPU.
"""

from __future__ import annotations

import torch

from runtime.triton_launch import Launch, check_rows, next_pow2

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

SILU_BLOCK = 1024

# fmt: off
if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(  # type: ignore[no-untyped-def]
        X, Delta, W, Out, Res, stride_x, stride_d, stride_o, stride_r, n, eps,
        HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_DELTA:
            d = tl.load(Delta + row * stride_d + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(X.dtype.element_ty)  # x + delta
            tl.store(Res + row * stride_r + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, 0) / n
        y = (xf * tl.rsqrt(var + eps)).to(X.dtype.element_ty)
        w = tl.load(W + cols, mask=mask, other=0.0)
        tl.store(Out + row * stride_o + cols, (w.to(tl.float32) * y.to(tl.float32)).to(Out.dtype.element_ty),
                 mask=mask)

    @triton.jit
    def _rope_kernel(  # type: ignore[no-untyped-def]
        Q, K, QOut, KOut, Cos, Sin, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
        stride_ot, stride_oh, stride_pt, stride_ph, NQ: tl.constexpr, HALF: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0)
        head = tl.program_id(1)  # q's heads, then k's
        is_q = head < NQ
        h = tl.where(is_q, head, head - NQ)
        src = tl.where(is_q, Q + t * stride_qt + h * stride_qh, K + t * stride_kt + h * stride_kh)
        dst = tl.where(is_q, QOut + t * stride_ot + h * stride_oh, KOut + t * stride_pt + h * stride_ph)
        i = tl.arange(0, BLOCK)  # HALF padded to a power of two (head_dim 96: 48 of 64)
        m = i < HALF
        x1 = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + i, mask=m, other=0.0).to(tl.float32)
        c1 = tl.load(Cos + t * stride_c + i, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(Cos + t * stride_c + HALF + i, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(Sin + t * stride_c + i, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(Sin + t * stride_c + HALF + i, mask=m, other=0.0).to(tl.float32)
        dt = QOut.dtype.element_ty
        # torch: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype
        out1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
        out2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        tl.store(dst + i, out1.to(dt), mask=m)
        tl.store(dst + HALF + i, out2.to(dt), mask=m)

    @triton.jit
    def _silu_mul_kernel(  # type: ignore[no-untyped-def]
        GateUp, Out, stride_g, stride_o, inter, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(GateUp + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GateUp + row * stride_g + inter + cols, mask=mask, other=0.0).to(tl.float32)
        dt = Out.dtype.element_ty
        act = (g / (1.0 + tl.exp(-g))).to(dt)  # F.silu, rounded to the dtype
        tl.store(Out + row * stride_o + cols, (act.to(tl.float32) * u).to(dt), mask=mask)
# fmt: on


def add_rms_norm_launch(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> Launch:
    """(rms_norm(x + delta), x + delta), or (rms_norm(x), x) without delta. x: [T, hidden]."""
    t, n = x.shape
    d = x if delta is None else delta
    check_rows(x, d)
    out = torch.empty_like(x)
    res = x if delta is None else torch.empty_like(x)
    return Launch(
        _add_rms_norm_kernel, (t,),
        (x, d, weight, out, res, x.stride(0), d.stride(0), out.stride(0), res.stride(0), n, eps),
        dict(HAS_DELTA=delta is not None, BLOCK=next_pow2(n)),
        (out, res),
    )  # fmt: skip


def rope_launch(
    q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> Launch:
    """q [T, H, D], k [T, KVH, D] (views of the qkv matmul's output) rotated into new
    contiguous tensors; cos, sin [T, 1, D] from RotaryEmbedding.lookup."""
    cos, sin = cos_sin
    t, heads, dim = q.shape
    check_rows(q, k, cos, sin)
    if sin.stride(0) != cos.stride(0):
        raise ValueError("rope: cos and sin must share their layout")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    return Launch(
        _rope_kernel, (t, heads + k.shape[1]),
        (q, k, q_out, k_out, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
         cos.stride(0), q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1)),
        # no FMA contraction: triton (3.6 and 3.8, sm_90) otherwise fuses a rounded product into
        # the sum (fma.rn.bf16 / fma.rn.f32), one rounding fewer than torch: seen on an H100
        dict(NQ=heads, HALF=dim // 2, BLOCK=next_pow2(dim // 2), enable_fp_fusion=False),
        (q_out, k_out),
    )  # fmt: skip


def silu_mul_launch(gate_up: torch.Tensor) -> Launch:
    """gate_up [T, 2 * inter] -> SiLU(gate) * up [T, inter]."""
    t, two_inter = gate_up.shape
    inter = two_inter // 2
    check_rows(gate_up)
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    return Launch(
        _silu_mul_kernel, (t, triton.cdiv(inter, SILU_BLOCK)),
        (gate_up, out, gate_up.stride(0), out.stride(0), inter),
        dict(BLOCK=SILU_BLOCK),
        out,
    )  # fmt: skip


class TritonOps:
    """LlamaModel's small ops as the kernels above (the interface of llama.TORCH_OPS)."""

    @staticmethod
    def add_rms_norm(
        x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out: tuple[torch.Tensor, torch.Tensor] = add_rms_norm_launch(x, delta, weight, eps).run()
        return out

    @staticmethod
    def rope_qk(
        q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out: tuple[torch.Tensor, torch.Tensor] = rope_launch(q, k, cos_sin).run()
        return out

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = silu_mul_launch(gate_up).run()
        return out


TRITON_OPS = TritonOps() if triton is not None else None
