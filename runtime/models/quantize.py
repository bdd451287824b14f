"""Weight-only int8 for the CPU (`--quantization int8`): every matmul weight of the model (q/k/v,
o, gate/up, down, the lm_head; not the embedding, norms or MoE experts) rounded to int8 per
output channel (symmetric: scale = max |w| / 127), once, after loading.

A step's rows decide the kernel (`Int8Linear`): up to `max_rows` rows (decode-sized steps) go
through torch's int8 weight-only GEMM (`torch._weight_int8pack_mm`, bf16 activations: it reads a
quarter of fp32's bytes, which is what a decode step waits for); more rows (prefill) go through
the same int8 weights dequantized to the model's dtype, at the speed of an fp32 matmul. So no
step is slower than fp32, and both paths compute with the same rounded weights; the cost is
memory (the int8 copy beside the dequantized one: 1.25x fp32's). bench/quality.py holds each
mode to its agreement gate; docs/performance.md has the numbers and the crossover measured here.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any

import torch

from runtime.models.linear import Linear


class Int8Linear:
    """y = x @ (q * scale).T + bias, q int8 [out, in], scale [out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool,
                 max_rows: int) -> None:
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.scale = scale.to(torch.bfloat16)  # what the int8 kernel takes with bf16 activations
        self.dequantized = Linear((self.q.float() * scale[:, None]).to(weight.dtype), bias, onednn)
        self.out_features, self.in_features = self.q.shape
        self.bias, self.max_rows = bias, max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > self.max_rows:
            return self.dequantized(x)
        flat = x.reshape(rows, self.in_features).to(torch.bfloat16)
        y = torch._weight_int8pack_mm(flat, self.q, self.scale).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def dense_weight(linear: Linear) -> torch.Tensor:
    """A Linear's weight as an ordinary tensor (a oneDNN weight is opaque until converted)."""
    return linear.weight.to_dense() if linear.onednn else linear.weight


def quantize_int8(model: Any, max_rows: int) -> int:
    """Replace every Linear reachable from `model` (its attributes, layer lists and the
    dataclasses and runtime.models objects they hold) by an Int8Linear; returns how many."""
    done = 0

    def visit(obj: Any) -> None:
        nonlocal done
        names = ([f.name for f in fields(obj)] if is_dataclass(obj) else list(vars(obj)))
        for name in names:
            value = getattr(obj, name)
            if isinstance(value, Linear):
                setattr(obj, name, Int8Linear(dense_weight(value), value.bias, value.onednn, max_rows))
                done += 1
            elif isinstance(value, list):
                for item in value:
                    if _ours(item):
                        visit(item)
            elif _ours(value):
                visit(value)

    visit(model)
    return done


def _ours(obj: Any) -> bool:
    """A model part to look inside: our dataclasses and classes, never a tensor or a matmul
    quantized already."""
    module = type(obj).__module__
    return module.startswith("runtime.models.") and hasattr(obj, "__dict__") \
        and not isinstance(obj, (torch.Tensor, Int8Linear))
