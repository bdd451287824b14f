"""Native CPU kernels (csrc/), compiled once per machine with its C++ compiler.

`load_paged_decode()` builds csrc/paged_decode.cpp with `torch.utils.cpp_extension` (about 5 s
the first time; ninja and g++ needed) into torch's extensions folder (TORCH_EXTENSIONS_DIR, else
$XDG_CACHE_HOME/torch_extensions, else ~/.cache/torch_extensions) and returns
`torch.ops.baton.paged_decode`; `load_paged_decode_fp8()` gives its twin over fp8 pages
(`torch.ops.baton.paged_decode_fp8`, from the same library). The library name carries a hash of
the source, the flags, torch's version and this CPU's feature flags, so a cached build is never
loaded on a CPU it was not compiled for (-march=native). Where there is no compiler it returns
None, says why once, and callers use plain torch.

torch serializes builds with a lock file in the build folder and waits for it without a limit; a
build that was killed leaves it behind, and every later start would wait for good. A lock older
than STALE_LOCK_S (a build takes seconds) is removed, also while this process waits on it: the
load then either finds the other process's library or fails, and callers use torch.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]  # OpenMP: at::parallel_for uses torch's threads
_LDFLAGS = ["-fopenmp"]
STALE_LOCK_S = 300.0


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
    lock = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
    done = threading.Event()
    threading.Thread(target=_break_stale, args=(lock, done), daemon=True,
                     name="native-build-lock").start()
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
    finally:
        done.set()
    log.info("native paged-decode kernel ready (%.1f s)", time.perf_counter() - start)
    return torch.ops.baton.paged_decode  # type: ignore[no-any-return]


def load_paged_decode_fp8() -> Callable[..., None] | None:
    """The paged decode attention op over float8_e4m3fn pages, or None where it cannot be built."""
    if load_paged_decode() is None:
        return None
    return torch.ops.baton.paged_decode_fp8  # type: ignore[no-any-return]


def clear_stale_lock(lock: Path, older_than_s: float = STALE_LOCK_S) -> bool:
    """Remove the build lock `lock` if it is older than `older_than_s` (its build was killed);
    whether it was removed."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= older_than_s:
        return False
    log.warning("removing %s, %.0f s old: the build that took it is gone", lock, age)
    lock.unlink(missing_ok=True)
    return True


def _break_stale(lock: Path, done: threading.Event) -> None:
    """While a load runs, remove its lock once it is stale (torch's wait has no limit)."""
    while not done.wait(1.0):
        clear_stale_lock(lock)
