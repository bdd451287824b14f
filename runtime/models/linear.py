"""Linear layers whose weights are prepared once for the fastest fp32 GEMM the device has.

On CPU, `F.linear` calls MKL's sgemm, which tops out near AVX2 speed on this AMD EPYC (~200
GFLOP/s on 2 cores, as if MKL did not pick its AVX-512 kernels on an AMD CPU). oneDNN
(`torch.ops.mkldnn._linear_pointwise` over a weight converted once with `.to_mkldnn()`) runs its
AVX-512 brgemm kernels in fp32 (ONEDNN_VERBOSE=1 shows `brg_matmul:avx512_core`). Measured here
with SmolLM2-135M's shapes at 64 rows: 2.0x faster for the layers, 2.8x for the 49k-vocab lm_head
(bench/linear_gemm.py). Both accumulate in fp32; only the summation order differs.

Backends: "torch" (plain `F.linear`, any device) and "onednn" (CPU, float32/bfloat16, torch
built with oneDNN). "auto" picks oneDNN where it can and torch elsewhere.
"""

from __future__ import annotations

import logging
from typing import Protocol, get_args

import torch
import torch.nn.functional as F

from runtime.config import LinearBackend

log = logging.getLogger(__name__)

LINEAR_BACKENDS: tuple[LinearBackend, ...] = get_args(LinearBackend)


class Matmul(Protocol):
    """What a model layer calls for a matmul: a Linear, or one with quantized weights
    (quantize.py, fp8_linear.py)."""

    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Linear:
    """y = x @ weight.T + bias. weight: [out, in]; x: [..., in] -> [..., out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool) -> None:
        self.out_features, self.in_features = weight.shape
        self.onednn = onednn
        # NOTE: a oneDNN weight is an opaque tensor: only _linear_pointwise may read it.
        self.weight = weight.to_mkldnn() if onednn else weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def onednn_available(device: str, dtype: torch.dtype) -> bool:
    """oneDNN linear works here: CPU, a dtype it computes, and torch built with the op."""
    if not device.startswith("cpu") or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:  # a build may list the op and still not run it for this dtype
        w, x = torch.ones(4, 8, dtype=dtype), torch.ones(2, 8, dtype=dtype)
        out = Linear(w, None, onednn=True)(x)
    except RuntimeError as e:
        log.warning("oneDNN linear unavailable (%s); using F.linear", e)
        return False
    return bool((out == 8).all())


def use_onednn(backend: LinearBackend, device: str, dtype: torch.dtype) -> bool:
    """Resolve the configured backend; asking for oneDNN where it cannot run is an error."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    available = onednn_available(device, dtype)
    if backend == "onednn" and not available:
        raise ValueError(
            f"linear_backend 'onednn' needs a CPU device, float32 or bfloat16 and torch built with "
            f"oneDNN (device {device!r}, dtype {dtype})"
        )
    return available
