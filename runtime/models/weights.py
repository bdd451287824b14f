"""A checkpoint's tensors as one rank takes them: each read from the safetensors files when the
model asks for it, whole or as this rank's rows or columns (tensor parallelism: parallel.py),
cast to the model's dtype and put on its device. A rank reads only its part of a split tensor,
except an fp8 weight, which is dequantized whole first (fp8.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from runtime.model_config import FP8Weights
from runtime.models.fp8 import dequantize, scale_name
from runtime.models.parallel import TensorParallel

_MISSING: Any = object()


class Weights:
    def __init__(self, path: Path, dtype: torch.dtype, device: str,
                 tp: TensorParallel | None = None, fp8: FP8Weights | None = None) -> None:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        self.dtype, self.device = dtype, device
        self.tp = tp or TensorParallel()
        self.fp8 = fp8
        self._files: dict[str, Any] = {}  # tensor name -> its open file
        for f in files:
            handle = safe_open(str(f), framework="pt", device="cpu")
            self._files.update(dict.fromkeys(handle.keys(), handle))

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def pop(self, name: str, default: Any = _MISSING) -> Any:
        """The whole tensor `name` (each rank holds it all), taken out; `default` if absent."""
        if name not in self._files and default is not _MISSING:
            return default
        return self._take(name, ...)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of `name` (an output-split matmul's or an embedding's part)."""
        return self._take(name, slice(start, stop))

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Columns [start, stop) of `name` (an input-split matmul's part)."""
        return self._take(name, (slice(None), slice(start, stop)))

    def split_rows(self, name: str) -> torch.Tensor:
        """This rank's equal share of `name`'s rows (column-parallel: gate, up, an expert's)."""
        return self.rows(name, *self.tp.part(self._shape(name)[0]))

    def split_cols(self, name: str) -> torch.Tensor:
        """This rank's equal share of `name`'s columns (row-parallel: o, down)."""
        return self.cols(name, *self.tp.part(self._shape(name)[1]))

    def _shape(self, name: str) -> list[int]:
        return list(self._files[name].get_slice(name).get_shape())

    def _take(self, name: str, index: Any) -> torch.Tensor:
        try:
            handle = self._files.pop(name)
        except KeyError:
            raise KeyError(f"the checkpoint has no tensor {name!r}") from None
        scale = scale_name(name, self._files) if self.fp8 is not None else None
        if scale is None:
            part = handle.get_slice(name)[index]
        else:
            assert self.fp8 is not None
            part = dequantize(handle.get_tensor(name), self._files.pop(scale).get_tensor(scale),
                              self.fp8)[index]
        return part.to(device=self.device, dtype=self.dtype)
