"""Linear: oneDNN and torch backends compute the same fp32 product; the choice is explicit."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from runtime.models.linear import Linear, onednn_available, use_onednn

needs_onednn = pytest.mark.skipif(
    not onednn_available("cpu", torch.float32), reason="torch built without oneDNN"
)


def test_onednn_is_there_on_x86_cpu_wheels() -> None:
    """Our pinned torch CPU wheel ships oneDNN: the fast path must not silently fall back."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("checked on x86 only")
    assert onednn_available("cpu", torch.float32)
    assert use_onednn("auto", "cpu", torch.float32)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_onednn_matches_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(960, 576, generator=g)
    b = torch.randn(960, generator=g) if bias else None
    x = torch.randn(rows, 576, generator=g)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = Linear(w, b, onednn=True)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 960)
    # fp32 accumulation (a bf16 shortcut would be off by ~1e-1 here)
    torch.testing.assert_close(got.double(), want, atol=5e-4, rtol=1e-5)
    torch.testing.assert_close(got, Linear(w, b, onednn=False)(x), atol=5e-4, rtol=1e-5)


@needs_onednn
def test_onednn_takes_a_row_subset() -> None:
    """The lm_head is applied to x[logits_rows]: a gathered, possibly strided, input."""
    w, x = torch.randn(100, 32), torch.randn(10, 32)
    got = Linear(w, None, onednn=True)(x[::3])
    torch.testing.assert_close(got, F.linear(x[::3], w), atol=1e-5, rtol=1e-5)


def test_backend_choice() -> None:
    assert not use_onednn("torch", "cpu", torch.float32)
    assert not use_onednn("auto", "cpu", torch.float16)  # oneDNN path is fp32/bf16 only
    assert not use_onednn("auto", "cuda:0", torch.float32)
    with pytest.raises(ValueError, match="onednn"):
        use_onednn("onednn", "cuda:0", torch.float32)
    with pytest.raises(ValueError, match="linear_backend"):
        use_onednn("mkl", "cpu", torch.float32)  # type: ignore[arg-type]
