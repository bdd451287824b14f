"""Native CPU kernels (csrc/), compiled once per machine with its C++ compiler.

`load_paged_decode()` builds csrc/paged_decode.cpp with `torch.utils.cpp_extension` (about 5 s
the first time; ninja and g++ needed) into torch's extensions folder (TORCH_EXTENSIONS_DIR, else
$XDG_CACHE_HOME/torch_extensions, else ~/.cache/torch_extensions) and returns
`torch.ops.baton.paged_decode`. The library name carries a hash of the source, the flags,
torch's version and this CPU's feature flags, so a cached build is never loaded on a CPU it was
not compiled for (-march=native). Where there is no compiler it returns None, says why once, and
callers use plain torch.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]  # OpenMP: at::parallel_for uses torch's threads
_LDFLAGS = ["-fopenmp"]


def _cpu_flags() -> bytes:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return b""
    return next((line for line in info.splitlines() if line.startswith("flags")), "").encode()


def _ensure_ninja_on_path() -> None:
    """The `ninja` PyPI package installs into the venv, not on PATH unless the venv is active."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # type: ignore[import-untyped]
    except ImportError:
        return
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


@functools.cache
def load_paged_decode() -> Callable[..., None] | None:
    """The paged decode attention op, or None where it cannot be built here."""
    from torch.utils import cpp_extension

    key = b"|".join([_SOURCE.read_bytes(), " ".join(_CFLAGS).encode(), torch.__version__.encode(),
                     _cpu_flags()])
    name = f"baton_paged_decode_{hashlib.sha256(key).hexdigest()[:16]}"
    _ensure_ninja_on_path()
    compiler = os.environ.get("CXX", "c++")
    if not shutil.which(compiler):
        log.warning("native paged-decode kernel unavailable (no C++ compiler %r); using torch "
                    "attention", compiler)
        return None
    start = time.perf_counter()
    try:
        cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=_CFLAGS,
            extra_ldflags=_LDFLAGS,
            is_python_module=False,
        )
    except (OSError, RuntimeError, ImportError) as e:
        lines = str(e).strip().splitlines() or [type(e).__name__]
        reason = next((line for line in lines if "error" in line.lower()), lines[-1])
        log.warning("native paged-decode kernel unavailable (%s); using torch attention", reason)
        return None
    log.info("native paged-decode kernel ready (%.1f s)", time.perf_counter() - start)
    return torch.ops.baton.paged_decode  # type: ignore[no-any-return]
