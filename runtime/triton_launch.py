"""What every Triton kernel of ours is launched through: a `Launch` (the kernel, its grid, its
arguments and compile-time constants). Callers run it; tests/attention/triton_offline.py
compiles the same launches for GPU targets on a machine without one."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


def interpreting() -> bool:
    """TRITON_INTERPRET=1: kernels run on CPU tensors, slowly (the CPU machines' tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class Launch:
    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constants: dict[str, Any]
    out: Any  # what run() returns: the output tensor(s) the kernel fills

    def run(self) -> Any:
        self.kernel[self.grid](*self.args, **self.constants)
        return self.out


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def check_rows(*tensors: torch.Tensor) -> None:
    """The kernels index rows by stride and elements within a row by 1."""
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"a kernel operand's last dimension must be contiguous: {t.stride()}")
