"""Weight-only int8 and int4 for the CPU (`--quantization int8|int4`): every matmul weight of the
model's layers (q/k/v, o, gate/up, down; not the embedding, norms or MoE experts) rounded once,
after loading: int8 per output channel (symmetric), int4 per group of 32 inputs (asymmetric,
GGUF Q4_1's grid). The lm_head: full precision under int8; under int4 two int4 passes, the weight
and then what the first left over (`Int4ResidualLinear`). One int4 pass over the lm_head cost
int4 16 points of next-token agreement on the builtin model (bench/quality.py), the second
pass gives nearly all of it back, and the two read a quarter of fp32's bytes: the fp32 lm_head
(49k rows) was a third of a one-row step.

A step's rows decide the kernel (`WeightOnlyLinear`): up to `max_rows` rows (decode-sized
steps) go through torch's weight-only GEMMs (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`,
bf16 activations: they read a quarter or an eighth of fp32's bytes, which is what a decode step
waits for); more rows (prefill) go through the same rounded weights dequantized to the model's
dtype, at an fp32 matmul's speed. So no step is slower than fp32, and both paths compute with
the same rounded weights; the cost is memory (the quantized copy beside the dequantized one). bench/quality.py holds each
mode to its agreement gate; docs/performance.md has the numbers and the crossover measured here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, is_dataclass
from typing import Any

import torch

from runtime.models.linear import Linear


class WeightOnlyLinear:
    """y = x @ dequantized.T + bias: through the quantized kernel (bf16 activations) for steps
    of up to `max_rows` rows, through the dequantized weights above."""

    def __init__(self, dequantized: torch.Tensor, bias: torch.Tensor | None, onednn: bool,
                 max_rows: int) -> None:
        self.out_features, self.in_features = dequantized.shape
        self.dequantized = Linear(dequantized, bias, onednn)
        self.bias, self.max_rows = bias, max_rows

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] bf16 -> [rows, out] (bf16, or float32) through the quantized weights."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > self.max_rows:
            return self.dequantized(x)
        y = self.kernel(x.reshape(rows, self.in_features).to(torch.bfloat16)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class Int8Linear(WeightOnlyLinear):
    """Symmetric int8 per output channel: w = q * scale, q in [-127, 127], scale = max|w| / 127."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool,
                 max_rows: int) -> None:
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.scale = scale.to(torch.bfloat16)  # what the kernel takes with bf16 activations
        super().__init__((self.q.float() * scale[:, None]).to(weight.dtype), bias, onednn, max_rows)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.q, self.scale)


def int4_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weight` [out, k] on the asymmetric int4 grid per group of `group` inputs: w = (q - 8) *
    scale + zero, q in [0, 15], the group's min and max on the grid's ends (GGUF Q4_1's grid:
    d * q + m, with zero = m + 8d), scale and zero in bf16 as torch's int4 kernel takes them.
    Returns (packed for that kernel, scales and zeros [k/group, out', 2], the rounded weight
    [out, k] in float32); the kernel takes rows in sixteens, so out' is out rounded up to 16
    (zero rows, which `int4_mm` cuts off)."""
    out, k = weight.shape
    if k % group:
        raise ValueError(f"int4 needs input sizes divisible by {group}, got {k}")
    padded = -(-out // 16) * 16
    w = torch.nn.functional.pad(weight.float(), (0, 0, 0, padded - out))
    g = w.view(padded, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12).to(torch.bfloat16).float()
    zero = (lo + 8 * scale).to(torch.bfloat16).float()
    q = torch.round((g - zero[..., None]) / scale[..., None] + 8).clamp(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(padded, k).int(), 1)
    scales_zeros = torch.stack([scale.T, zero.T], -1).to(torch.bfloat16)
    return packed, scales_zeros, ((q - 8) * scale[..., None] + zero[..., None]).view(padded, k)[:out]


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group: int, scales_zeros: torch.Tensor,
            out: int) -> torch.Tensor:
    """x [rows, k] bf16 times an `int4_groups` weight of `out` rows: [rows, out] bf16."""
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)
    return y if y.shape[1] == out else y[:, :out]


class Int4Linear(WeightOnlyLinear):
    """Asymmetric int4 per group of `GROUP` inputs (`int4_groups`), for both paths."""

    GROUP = 32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool,
                 max_rows: int) -> None:
        self.packed, self.scales_zeros, deq = int4_groups(weight, self.GROUP)
        super().__init__(deq.to(weight.dtype), bias, onednn, max_rows)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        return int4_mm(x, self.packed, self.GROUP, self.scales_zeros, self.out_features)


class Int4ResidualLinear(WeightOnlyLinear):
    """Two int4 passes: w = first + second, `first` the weight on the int4 grid and `second`
    what it left over, on a grid of its own (about 8 bits a weight in all, in groups of 32);
    the kernel path adds the two kernels' outputs in float32."""

    GROUP = 32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool,
                 max_rows: int) -> None:
        self.first = int4_groups(weight, self.GROUP)
        self.second = int4_groups(weight.float() - self.first[2], self.GROUP)
        super().__init__((self.first[2] + self.second[2]).to(weight.dtype), bias, onednn, max_rows)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        (p1, sz1, _), (p2, sz2, _) = self.first, self.second
        n = self.out_features
        return int4_mm(x, p1, self.GROUP, sz1, n).float() + int4_mm(x, p2, self.GROUP, sz2, n).float()


KINDS: dict[str, type[WeightOnlyLinear]] = {"int8": Int8Linear, "int4": Int4Linear}


def dense_weight(linear: Linear) -> torch.Tensor:
    """A Linear's weight as an ordinary tensor (a oneDNN weight is opaque until converted)."""
    return linear.weight.to_dense() if linear.onednn else linear.weight


def quantize(model: Any, kind: str, max_rows: int) -> int:
    """Replace every Linear reachable from `model.layers` by a `kind` (int8, int4) weight-only
    one, and under int4 the lm_head by an `Int4ResidualLinear`; returns how many."""
    cls = KINDS[kind]
    done = replace_linears(model, lambda lin: cls(dense_weight(lin), lin.bias, lin.onednn, max_rows))
    head = getattr(model, "lm_head", None)
    if kind == "int4" and isinstance(head, Linear):
        model.lm_head = Int4ResidualLinear(dense_weight(head), head.bias, head.onednn, max_rows)
        done += 1
    return done


def replace_linears(model: Any, swap: Callable[[Linear], Any | None]) -> int:
    """Replace every Linear reachable from `model.layers` (their attributes and the dataclasses
    and runtime.models objects they hold; not the lm_head) by `swap(linear)`, where that is not
    None; returns how many were replaced."""
    done = 0

    def visit(obj: Any) -> None:
        nonlocal done
        names = ([f.name for f in fields(obj)] if is_dataclass(obj) else list(vars(obj)))
        for name in names:
            value = getattr(obj, name)
            if isinstance(value, Linear):
                new = swap(value)
                if new is not None:
                    setattr(obj, name, new)
                    done += 1
            elif isinstance(value, list):
                for item in value:
                    if _ours(item):
                        visit(item)
            elif _ours(value):
                visit(value)

    for layer in model.layers:
        visit(layer)
    return done


def _ours(obj: Any) -> bool:
    """A model part to look inside: our dataclasses and classes, never a tensor or a matmul
    quantized already."""
    module = type(obj).__module__
    return module.startswith("runtime.models.") and hasattr(obj, "__dict__") \
        and not isinstance(obj, (torch.Tensor, WeightOnlyLinear))
