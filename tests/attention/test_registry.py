"""Attention backends by name: what `auto` picks, and clear errors for what cannot run here."""

from __future__ import annotations

import pytest
import torch

from runtime.attention.base import BackendUnavailable
from runtime.attention.cpu_backend import CpuAttention
from runtime.attention.registry import create_attention_backend
from runtime.attention.torch_backend import TorchAttention
from runtime.kvcache.pool import KVPool
from runtime.kvcache.req_to_token import ReqToTokenPool


def make(name: str, dtype: torch.dtype = torch.float32,
         windows: tuple[int | None, ...] = ()) -> object:
    pool = KVPool(2, 8, 4, 3, 64, dtype)
    return create_attention_backend(name, pool, ReqToTokenPool(4, 32), 0.125, windows)


def test_auto_on_cpu_is_the_native_kernel_else_torch() -> None:
    assert isinstance(make("auto"), CpuAttention)
    assert type(make("auto", torch.bfloat16)) is TorchAttention  # the kernel is float32 only


def test_what_cannot_run_here_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailable, match=r"triton package is not installed|needs a CUDA"):
        make("triton")
    with pytest.raises(BackendUnavailable, match=r"flashinfer package is not installed|needs a CUDA"):
        make("flashinfer")
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'.*'triton'"):
        make("flash")


def test_flashinfer_refuses_sliding_windows_and_auto_keeps_them() -> None:
    """flashinfer's window is not wired: a model with sliding-window layers is refused by name,
    before anything about the machine; `auto` picks a backend that applies every window."""
    with pytest.raises(BackendUnavailable, match=r"sliding-window layers .* triton .* torch"):
        make("flashinfer", windows=(8, None))
    attn = make("auto", windows=(8, None))
    assert isinstance(attn, CpuAttention) and attn.windows == (8, None)
