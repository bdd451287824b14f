"""The fp8 GEMM path (runtime/models/fp8_linear.py, fp8_gemm.py, fp8.py's FP8Weight) on the CPU:
the Triton block-FP8 kernel under TRITON_INTERPRET=1 (fp8 operands run there) against float64
products of the dequantized operands, partial blocks and 1 or 37 rows included; the activation
quantizer against its definition; the `torch._scaled_mm` wrapper (torch runs it on the CPU too)
and the reference GEMM against float64; an fp8 checkpoint's weights kept in fp8 as a rank reads
them (rows anywhere, columns on block edges, else dequantized); and a whole model on the fp8
path against the same model dequantized at load."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from runtime.model_config import FP8Weights
from runtime.models.fp8 import FP8_MAX, FP8Weight, dequantize
from runtime.models.fp8_gemm import block_fp8_gemm_launch
from runtime.models.fp8_linear import (
    FP8Linear,
    build_linear,
    quantize_rows,
    reference_gemm,
    scaled_mm_gemm,
)
from runtime.models.linear import Linear
from runtime.models.parallel import TensorParallel
from runtime.models.weights import Weights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fp8(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * 40).to(torch.float8_e4m3fn)


def _grouped(scale: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, groups] scales -> [rows, k], each over its 128 columns (computed here)."""
    return torch.stack([scale[:, c // 128] for c in range(k)], dim=1)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 192, 320), (37, 192, 320), (37, 320, 192),
                                           (20, 256, 128)])
def test_the_block_kernel_equals_float64(m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * n + k)
    groups = -(-k // 128)
    a, b = _fp8((m, k), gen), _fp8((n, k), gen)
    a_s = torch.rand(m, groups, generator=gen) + 0.25  # every row and group its own scale
    b_s = torch.rand(n, groups, generator=gen) + 0.25
    out = block_fp8_gemm_launch(a.to(DEVICE), a_s.to(DEVICE), b.to(DEVICE), b_s.to(DEVICE), 128,
                                torch.float32).run().cpu()
    ref = (a.double() * _grouped(a_s, k).double()) @ (b.double() * _grouped(b_s, k).double()).T
    assert out.shape == (m, n)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-3 * ref.abs().max().item())


def test_the_block_kernel_reads_strided_activations() -> None:
    """quantize_rows hands the kernel a view whose rows are padded to whole groups."""
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 200, generator=gen), torch.randn(64, 200, generator=gen)
    xq, xs = quantize_rows(x, 128)
    assert xq.stride(0) == 256
    weight = FP8Weight.quantize(w)
    weight = FP8Weight(weight.data, weight.scale.expand(64, 2).contiguous(), 128)
    torch.testing.assert_close(block_fp8_gemm_launch(xq, xs, weight.data, weight.scale, 128,
                                                     torch.float32).run(),
                               reference_gemm(xq, xs, weight, torch.float32), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("group", [None, 128])
def test_quantize_rows_scales_each_row_or_group_to_fp8s_range(group: int | None) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 320, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1e3])[:, None]
    x[1, 300] = 500.0  # in the last (short) group only
    q, s = quantize_rows(x, group)
    spans = [(0, 320)] if group is None else [(0, 128), (128, 256), (256, 320)]
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (4, len(spans))
    for g, (c0, c1) in enumerate(spans):
        amax = x[:, c0:c1].abs().amax(dim=1)
        torch.testing.assert_close(s[:, g], amax / FP8_MAX)
        assert torch.equal(q[:, c0:c1].float().abs().amax(dim=1), torch.full((4,), FP8_MAX))
        back = q[:, c0:c1].float() * s[:, g:g + 1]
        err = (back - x[:, c0:c1]).abs()  # e4m3: 3 mantissa bits, subnormals below 2^-6
        assert (err <= x[:, c0:c1].abs() / 16 + s[:, g:g + 1] * 2.0**-10).all()


def test_the_scaled_mm_wrapper_and_the_reference_equal_float64() -> None:
    """Per-row scales on both sides (per token, per output channel): torch._scaled_mm's product
    (bf16 out, as on CUDA) and the float32 reference against float64."""
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(37, 192, generator=gen), torch.randn(320, 192, generator=gen)
    w[7] *= 50  # one output channel far from the others
    weight = FP8Weight.quantize(w)
    xq, xs = quantize_rows(x, None)
    ref = (xq.double() * xs.double()) @ (weight.data.double() * weight.scale.double()).T
    torch.testing.assert_close(reference_gemm(xq, xs, weight, torch.float64), ref, rtol=1e-5,
                               atol=1e-4)
    out = scaled_mm_gemm(xq, xs, weight, torch.float32)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@pytest.mark.parametrize("group", [None, 128])
def test_an_fp8_linear_is_close_to_the_full_precision_matmul(group: int | None) -> None:
    """x @ w.T through fp8 on both sides: off by fp8's rounding of x (a few percent), no more."""
    gen = torch.Generator().manual_seed(3)
    x, w, bias = torch.randn(2, 5, 320, generator=gen), torch.randn(192, 320, generator=gen), \
        torch.randn(192, generator=gen)
    weight = FP8Weight.quantize(w)
    if group is not None:  # the same values under grouped scales
        weight = FP8Weight(weight.data, weight.scale.expand(192, 3).contiguous(), group)
    lin = FP8Linear(weight, bias, reference_gemm if group is None else None)
    out = lin(x)
    exact = x.double() @ weight.dequantize().double().T + bias.double()
    assert out.shape == (2, 5, 192)
    rel = (out.double() - exact).norm() / exact.norm()
    assert rel < 0.05, rel


def _checkpoint(tmp_path: Path, fmt: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """One fp8 weight [320, 384] in `fmt`, and what it stands for (dequantized by fp8.py)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(4)
    data = _fp8((320, 384), gen)
    scale = torch.rand((3, 3) if fmt == "block" else (320, 1), generator=gen) + 0.25
    save_file({"w.weight": data, f"w.weight_scale{'_inv' if fmt == 'block' else ''}": scale},
              str(tmp_path / "model.safetensors"))
    fp8 = FP8Weights((128, 128) if fmt == "block" else None)
    return tmp_path, {"full": dequantize(data, scale, fp8), "fp8": fp8}  # type: ignore[dict-item]


@pytest.mark.parametrize("fmt", ["block", "channel"])
@pytest.mark.parametrize(("rank", "size"), [(0, 1), (0, 2), (1, 2), (2, 3)])
def test_a_rank_reads_its_fp8_part_with_its_scales(fmt: str, rank: int, size: int,
                                                   tmp_path: Path) -> None:
    """Rows split anywhere (320 / 3 is not a block edge); columns 384 / 2 = 192 cut a block:
    that part comes dequantized (block), 384 / 3 = 128 does not."""
    path, ref = _checkpoint(tmp_path, fmt)
    fp8: Any = ref["fp8"]
    tp = TensorParallel(rank, size)
    for dim in (0, 1):
        w = Weights(path, torch.float32, "cpu", tp, fp8, keep_fp8=True)
        part = w.split_matmul("w.weight", dim)
        share = 320 // size if dim == 0 else 384 // size
        span = slice(rank * share, (rank + 1) * share)
        want = ref["full"][span] if dim == 0 else ref["full"][:, span]
        cut = fmt == "block" and dim == 1 and share % 128 != 0
        assert isinstance(part, torch.Tensor) == cut
        got = part if isinstance(part, torch.Tensor) else part.dequantize()
        assert torch.equal(got, want)


def test_parts_of_one_matmul_stay_fp8_only_together() -> None:
    gen = torch.Generator().manual_seed(6)
    a, b = FP8Weight.quantize(torch.randn(48, 64, generator=gen)), \
        FP8Weight.quantize(torch.randn(16, 64, generator=gen))
    both = build_linear([a, b], None, False, torch.float32, "qkv")
    assert isinstance(both, FP8Linear)
    assert torch.equal(both.weight.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    mixed = build_linear([a, b.dequantize()], None, False, torch.float32, "qkv")
    assert isinstance(mixed, Linear)
    assert torch.equal(mixed.weight, torch.cat([a.dequantize(), b.dequantize()]))
    odd = FP8Weight.quantize(torch.randn(40, 64, generator=gen))  # _scaled_mm: 40 % 16 != 0
    assert isinstance(build_linear([odd], None, False, torch.float32, "o"), Linear)
