"""Attention backends by name; each implementation is imported only when it is asked for.

Registered: "torch" (plain torch, any device), "cpu" (torch plus a native decode kernel, float32
on CPU), "triton" (paged Triton kernels, CUDA; on CPU only under TRITON_INTERPRET=1, for tests),
"flashinfer" (CUDA, float16/bfloat16). "auto" (the default) picks "cpu" for a CPU pool and
"triton" for a CUDA pool when each can be used there, else "torch". Every backend reads an fp8
pool (--kv-cache-dtype fp8_e4m3: runtime/kvcache/fp8.py); triton on sm_89 or later. A factory is "module:callable" taking
(pool, req_to_token, scale, windows), so CUDA-only modules are never imported on the CPU path.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence

from runtime.attention.base import AttentionBackend, BackendUnavailable
from runtime.kvcache.pool import KVPool
from runtime.kvcache.req_to_token import ReqToTokenPool

log = logging.getLogger(__name__)

_REGISTRY: dict[str, str] = {
    "torch": "runtime.attention.torch_backend:TorchAttention",
    "cpu": "runtime.attention.cpu_backend:CpuAttention.create",
    "triton": "runtime.attention.triton_backend:TritonAttention.create",
    "flashinfer": "runtime.attention.flashinfer_backend:FlashInferAttention.create",
}
_AUTO = {"cpu": "cpu", "cuda": "triton"}  # device type -> what "auto" tries before "torch"


def register_attention_backend(name: str, factory_path: str) -> None:
    """`factory_path` is "package.module:callable" (a class, or a dotted classmethod)."""
    _REGISTRY[name] = factory_path


def create_attention_backend(
    name: str, pool: KVPool, req_to_token: ReqToTokenPool, scale: float,
    windows: Sequence[int | None] = (),
) -> AttentionBackend:
    """`windows`: each layer's sliding window (AttentionBackend.__init__)."""
    if name == "auto":
        preferred = _AUTO.get(pool.device.type)
        if preferred is not None:
            try:
                return _create(preferred, pool, req_to_token, scale, windows)
            except BackendUnavailable as e:
                log.info("attention: %s; using 'torch'", e)
        return _create("torch", pool, req_to_token, scale, windows)
    if name not in _REGISTRY:
        known = sorted([*_REGISTRY, "auto"])
        raise ValueError(f"unknown attention backend {name!r}; known: {known}")
    return _create(name, pool, req_to_token, scale, windows)


def _create(
    name: str, pool: KVPool, req_to_token: ReqToTokenPool, scale: float,
    windows: Sequence[int | None],
) -> AttentionBackend:
    module, _, attr = _REGISTRY[name].partition(":")
    factory: object = importlib.import_module(module)
    for part in attr.split("."):
        factory = getattr(factory, part)
    backend = factory(pool, req_to_token, scale, windows)  # type: ignore[operator]
    assert isinstance(backend, AttentionBackend)
    return backend
