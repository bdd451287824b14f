"""FP8 checkpoints: matmul weights stored as float8_e4m3fn with float32 scales beside them.

Two formats (runtime/config.py FP8Weights): per 128x128 block, the scale of block (i, j) in
`X.weight_scale_inv[i, j]` (DeepSeek-V3, Qwen3-FP8; despite the name it multiplies); or per
tensor / per output channel in `X.weight_scale` (fp8 without blocks, compressed-tensors). Either
way weight = fp8 value * its scale.

Here they are dequantized once, at load, to the model's dtype: a correct path on every device,
not a fast one (the weights take their full-precision size in memory). Tensor parallelism
splits the dequantized weight, so a rank's part always has its own scales.
"""

from __future__ import annotations

import torch

from runtime.model_config import FP8Weights

BLOCK_SCALE, SCALE = "_scale_inv", "_scale"  # suffixes of a weight's scale tensor


def scale_name(weight: str, names: set[str] | dict[str, object]) -> str | None:
    """The scale tensor of fp8 weight `weight` among `names` (None: it has none)."""
    return next((weight + s for s in (BLOCK_SCALE, SCALE) if weight + s in names), None)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, fp8: FP8Weights) -> torch.Tensor:
    """weight (float8_e4m3fn [out, in]) times its scales, in float32."""
    w, s = weight.float(), scale.float()
    if fp8.block is not None and s.dim() == 2:
        rows, cols = fp8.block
        grid = s.repeat_interleave(rows, 0)[: w.shape[0]].repeat_interleave(cols, 1)[:, : w.shape[1]]
        if grid.shape != w.shape:
            raise ValueError(f"block scales {tuple(s.shape)} do not cover a weight of "
                             f"{tuple(w.shape)} in {rows}x{cols} blocks")
        return w * grid
    if s.numel() == 1:
        return w * s.reshape(())
    if s.numel() == w.shape[0]:
        return w * s.reshape(-1, 1)
    raise ValueError(f"scales {tuple(s.shape)} fit neither a tensor, its {w.shape[0]} channels "
                     "nor 2-D blocks")
