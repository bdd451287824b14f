"""A worker's revision: which deployment revision it belongs to (issue 39, docs/rollouts.md).

A prefill hands its KV only to a decode of its own revision, and KV moves between decodes only
within one: two revisions may compute different KV for the same tokens (another model, dtype,
quantization, runtime), and such KV would give a wrong answer with 200 OK. The revision
travels in the KV layout (runtime/disagg/wire.py `KVLayout.revision`), so the router pairs only
workers that agree, and the handshake refuses the rest naming both revisions.

`--revision` (or $BATON_REVISION) sets it: the operator renders one for both pools of a spec,
a digest of everything in it that changes what the workers compute. Without one a worker
derives its own from what it computes with (`derive`): the runtime's code, the model, dtype,
KV cache dtype and quantization; not its role, TP size, ports or pool size, which may differ
between a prefill and the decode it pairs with.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.config import EngineConfig

ENV = "BATON_REVISION"
RUNTIME = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A digest of the runtime's own code (its .py and .cpp files, by path and content)."""
    h = hashlib.sha256()
    for path in sorted(p for p in RUNTIME.rglob("*") if p.suffix in (".py", ".cpp")
                       and "__pycache__" not in p.parts):
        h.update(str(path.relative_to(RUNTIME)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def derive(engine: EngineConfig) -> str:
    """The revision of a worker that was given none: 12 hex digits."""
    what = {"code": code_digest(), "model": engine.model, "dtype": engine.dtype,
            "kv_cache_dtype": engine.kv_cache_dtype, "quantization": engine.quantization,
            "fp8_gemm": engine.fp8_gemm}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]


def check(revision: str) -> str | None:
    """Why `revision` cannot be one (None: it can): 1-64 characters of [A-Za-z0-9._-]."""
    if not 1 <= len(revision) <= 64 or not all(c.isalnum() or c in "._-" for c in revision):
        return f"--revision {revision!r}: 1-64 letters, digits, '.', '_' or '-'"
    return None
