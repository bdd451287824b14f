"""FP8 checkpoints: matmul weights stored as float8_e4m3fn with float32 scales beside them.

Two formats (runtime/config.py FP8Weights): per 128x128 block, the scale of block (i, j) in
`X.weight_scale_inv[i, j]` (DeepSeek-V3, Qwen3-FP8; despite the name it multiplies); or per
tensor / per output channel in `X.weight_scale` (fp8 without blocks, compressed-tensors). Either
way weight = fp8 value * its scale.

Two ways to load them:
- dequantized once, at load, to the model's dtype (`dequantize`): a correct path on every
  device, not a fast one (the weights take their full-precision size in memory); tensor
  parallelism splits the dequantized weight, so a rank's part always has its own scales. The
  CPU's path, and CUDA's before sm_89.
- kept in fp8 (`FP8Weight`, `load_part`), for the fp8 GEMMs (fp8_linear.py) on CUDA: the rank's
  rows and columns of the fp8 weight with the scales of exactly those, read together. Scales
  are held per row: [rows, groups], a 128x128 block's scale repeated on each of its rows and a
  tensor's on every row, so rows may be split and concatenated (q/k/v, gate/up) anywhere.
  Columns (row-parallel o and down) split only on a block's edge; elsewhere `load_part` says
  no and the weight is dequantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


@dataclass
class FP8Weight:
    """A matmul weight kept in fp8: w[r, c] = data[r, c] * scale[r, c // group]."""

    data: torch.Tensor  # [out, in] float8_e4m3fn
    scale: torch.Tensor  # [out, groups] float32
    group: int | None  # columns per scale (None: one scale per row, groups = 1)

    def dequantize(self) -> torch.Tensor:
        """The weight it stands for, in float32 [out, in]."""
        return self.data.float() * self.column_scales()

    def column_scales(self) -> torch.Tensor:
        """Each element's scale, broadcastable to [out, in]."""
        if self.group is None:
            return self.scale
        return self.scale.repeat_interleave(self.group, 1)[:, : self.data.shape[1]]

    def to(self, device: str | torch.device) -> FP8Weight:
        return FP8Weight(self.data.to(device), self.scale.to(device), self.group)

    @staticmethod
    def cat(parts: list[FP8Weight]) -> FP8Weight:
        """The parts' rows one after another (all of one group size)."""
        if len({p.group for p in parts}) != 1:
            raise ValueError("fp8 weights of different scale groups cannot be concatenated")
        return FP8Weight(torch.cat([p.data for p in parts]).contiguous(),
                         torch.cat([p.scale for p in parts]).contiguous(), parts[0].group)

    @staticmethod
    def quantize(w: torch.Tensor) -> FP8Weight:
        """A full-precision weight [out, in] in fp8 with one scale per row (max |w| / 448):
        `--quantization fp8`."""
        wf = w.float()
        scale = wf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        q = (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return FP8Weight(q, scale, None)


FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def load_part(weight: Any, shape: list[int], scale: torch.Tensor, fp8: FP8Weights,
              rows: tuple[int, int], cols: tuple[int, int]) -> FP8Weight | None:
    """Rows [r0, r1) and columns [c0, c1) of the fp8 weight behind `weight` (a safetensors slice
    of `shape`), with their scales; None when the columns cut a block (the caller dequantizes)."""
    (r0, r1), (c0, c1) = rows, cols
    s = scale.float()
    if fp8.block is not None and s.dim() == 2:
        block_rows, group = fp8.block
        if c0 % group or (c1 % group and c1 != shape[1]):
            return None
        s = s.repeat_interleave(block_rows, 0)[r0:r1, c0 // group: -(-c1 // group)]
    else:
        group = None
        s = s.reshape(1, 1).expand(shape[0], 1) if s.numel() == 1 else s.reshape(-1, 1)
        s = s[r0:r1]
    data = weight[r0:r1, c0:c1]
    if s.shape[0] != data.shape[0]:
        raise ValueError(f"scales {tuple(scale.shape)} do not cover a weight of {tuple(shape)}")
    return FP8Weight(data.contiguous(), s.contiguous(), group)
