"""A checkpoint's tensors as one rank takes them: each read from the safetensors files when the
model asks for it, whole or as this rank's rows or columns (tensor parallelism: parallel.py),
cast to the model's dtype and put on its device. A rank reads only its part of a split tensor,
except an fp8 weight that is dequantized, which is read whole first (fp8.py).

Matmul weights are asked for with `matmul`: with `keep_fp8` (CUDA's fp8 GEMMs, fp8_linear.py)
an fp8 weight comes as an `FP8Weight`, this rank's rows or columns and their scales, unless its
columns cut a 128-column block (then dequantized, with a log line)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from runtime.model_config import FP8Weights
from runtime.models.fp8 import FP8Weight, dequantize, load_part, scale_name
from runtime.models.parallel import TensorParallel

log = logging.getLogger(__name__)
_MISSING: Any = object()


class Weights:
    def __init__(self, path: Path, dtype: torch.dtype, device: str,
                 tp: TensorParallel | None = None, fp8: FP8Weights | None = None,
                 keep_fp8: bool = False) -> None:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        self.dtype, self.device = dtype, device
        self.tp = tp or TensorParallel()
        self.fp8, self.keep_fp8 = fp8, keep_fp8 and fp8 is not None
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

    def matmul(self, name: str, rows: tuple[int, int] | None = None,
               cols: tuple[int, int] | None = None) -> torch.Tensor | FP8Weight:
        """Rows and columns (None: all) of matmul weight `name`: kept in fp8 where `keep_fp8`
        and the checkpoint has it so, else as `rows` / `cols` give it."""
        shape = self._shape(name)
        rows, cols = rows or (0, shape[0]), cols or (0, shape[1])
        scale = scale_name(name, self._files) if self.keep_fp8 else None
        if scale is not None:
            assert self.fp8 is not None
            part = load_part(self._files[name].get_slice(name), shape,
                             self._files[scale].get_tensor(scale), self.fp8, rows, cols)
            if part is not None:
                del self._files[name], self._files[scale]
                return part.to(self.device)
            log.info("fp8: %s dequantized (its columns %d:%d cut a %s block)", name, *cols,
                     self.fp8.block)
        return self._take(name, (slice(*rows), slice(*cols)))

    def split_matmul(self, name: str, dim: int) -> torch.Tensor | FP8Weight:
        """This rank's equal share of matmul weight `name` along `dim` (0: column-parallel,
        1: row-parallel), as `matmul` gives it."""
        part = self.tp.part(self._shape(name)[dim])
        return self.matmul(name, rows=part) if dim == 0 else self.matmul(name, cols=part)

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
