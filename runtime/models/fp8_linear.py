"""Matmuls with fp8 weights on CUDA (an FP8 checkpoint, or `--quantization fp8`): the weight
stays in float8_e4m3fn with its scales (fp8.py `FP8Weight`), each step's activations are
quantized to fp8 on the fly, and one fp8 GEMM computes y in the model's dtype.

Activations are quantized per row (`quantize_rows`): per token with one scale, or per token per
group of 128 columns where the weight's scales are grouped (block-wise checkpoints), scale =
max |x| / 448 over the row or group. Two GEMMs (`FP8Gemm`), chosen by the weight's scales:
  scaled_mm   per-row weight scales (per channel, per tensor, `--quantization fp8`):
              `torch._scaled_mm` with row-wise scales on both sides, bf16 out (its only
              row-wise output type), cast to the model's dtype
  block       grouped weight scales (128x128 blocks): the Triton kernel of fp8_gemm.py
`reference_gemm` is the same product in float32 torch ops on any device: the CPU tests hold the
quantizer and the scale math to it, and the kernels to float64. On the CPU the engine does not
use this module: FP8 checkpoints are dequantized at load there (fp8.py).

Where an fp8 GEMM cannot run (a GPU before sm_89, sizes `torch._scaled_mm` refuses), the weight
is dequantized instead, and a log line says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from runtime.models.fp8 import FP8_MAX, FP8Weight
from runtime.models.linear import Linear
from runtime.models.quantize import dense_weight, replace_linears

log = logging.getLogger(__name__)

# (fp8 activations [M, K], their scales [M, groups], the weight, out dtype) -> y [M, N]
FP8Gemm = Callable[[torch.Tensor, torch.Tensor, FP8Weight, torch.dtype], torch.Tensor]


def quantize_rows(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scales [M, groups]): each row, or each group of `group`
    columns of a row (the last one may be short), scaled so that its max |x| is fp8's 448."""
    m, k = x.shape
    xf = x.float()
    if group is None:
        g = xf.view(m, 1, k)
    else:
        g = F.pad(xf, (0, -k % group)).view(m, -1, group)
    scale = g.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX  # [M, groups]
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, -1)[:, :k], scale


def reference_gemm(xq: torch.Tensor, xs: torch.Tensor, w: FP8Weight,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """The fp8 product in float32 torch ops (any device): dequantize both sides, multiply."""
    x = FP8Weight(xq, xs, w.group).dequantize()
    return (x @ w.dequantize().T).to(out_dtype)


def scaled_mm_gemm(xq: torch.Tensor, xs: torch.Tensor, w: FP8Weight,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """CUDA, per-row scales on both sides: torch._scaled_mm (its b column-major: w.data [N, K]
    row-major, transposed)."""
    y = torch._scaled_mm(xq.contiguous(), w.data.t(), scale_a=xs, scale_b=w.scale.view(1, -1),
                         out_dtype=torch.bfloat16)
    return y.to(out_dtype)


def block_gemm(xq: torch.Tensor, xs: torch.Tensor, w: FP8Weight,
               out_dtype: torch.dtype) -> torch.Tensor:
    """CUDA (or the Triton interpreter), grouped scales: fp8_gemm.py's kernel."""
    from runtime.models.fp8_gemm import block_fp8_gemm_launch

    assert w.group is not None
    out: torch.Tensor = block_fp8_gemm_launch(xq, xs, w.data, w.scale, w.group, out_dtype).run()
    return out


class FP8Linear:
    """y = x @ w.T + bias for an fp8 weight w: x quantized as w's scales are grouped, then the
    fp8 GEMM (`gemm`; by default the one for w's scales)."""

    def __init__(self, weight: FP8Weight, bias: torch.Tensor | None,
                 gemm: FP8Gemm | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.data.shape
        self.gemm = gemm or (scaled_mm_gemm if weight.group is None else block_gemm)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        xq, xs = quantize_rows(x.reshape(rows, self.in_features), self.weight.group)
        y = self.gemm(xq, xs, self.weight, x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def fp8_gemms_run(device: torch.device | str) -> bool:
    """This device runs fp8 GEMMs: CUDA at sm_89 or later (fp8 tensor cores)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm_fits(weight: FP8Weight) -> bool:
    """torch._scaled_mm takes the weight: in and out features multiples of 16."""
    out, k = weight.data.shape
    return out % 16 == 0 and k % 16 == 0


def build_linear(parts: list[torch.Tensor | FP8Weight], bias: torch.Tensor | None,
                 onednn: bool, dtype: torch.dtype, name: str) -> Linear | FP8Linear:
    """One matmul from its weight's parts (rows one after another: q/k/v, gate/up): an
    FP8Linear when every part is kept in fp8 and a kernel takes it, else a Linear of the
    dequantized weight."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        tensors = [p for p in parts if isinstance(p, torch.Tensor)]
        return Linear(tensors[0] if len(tensors) == 1 else torch.cat(tensors), bias, onednn)
    fp8 = [p for p in parts if isinstance(p, FP8Weight)]
    if len(fp8) == len(parts) and len({p.group for p in fp8}) == 1:
        weight = fp8[0] if len(fp8) == 1 else FP8Weight.cat(fp8)
        if weight.group is not None or scaled_mm_fits(weight):
            return FP8Linear(weight, bias)
        why = f"torch._scaled_mm needs sizes that are multiples of 16, not {tuple(weight.data.shape)}"
    else:
        why = "some of its parts could not be kept in fp8"
    log.info("fp8: %s dequantized (%s)", name, why)
    dense = [p if isinstance(p, torch.Tensor) else p.dequantize().to(dtype) for p in parts]
    return Linear(torch.cat(dense), bias, onednn)


def quantize_fp8(model: Any, gemm: FP8Gemm | None = None) -> int:
    """`--quantization fp8`: every matmul of `model.layers` (quantize.replace_linears: not the
    lm_head, norms or MoE experts) an FP8Linear with one scale per output channel; returns how
    many. A weight torch._scaled_mm cannot take stays as it is. `gemm`: the product to use
    (default: torch._scaled_mm; bench/quality.py measures with `reference_gemm` on the CPU)."""

    def swap(linear: Linear) -> FP8Linear | None:
        weight = FP8Weight.quantize(dense_weight(linear))
        return FP8Linear(weight, linear.bias, gemm) if scaled_mm_fits(weight) else None

    return replace_linears(model, swap)
