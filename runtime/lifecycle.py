"""Process hygiene: every process baton starts ends when its parent does, and what a killed
process leaves behind (its IPC directory) is cleaned at the next start.

Linux's parent-death signal covers a parent that is SIGKILLed (no cleanup code runs then);
elsewhere `die_with_parent` does nothing and the parent's own shutdown must do the work.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
IPC_PREFIX = "baton-ipc-"
# a Unix socket's path, the terminating NUL included, fits in sockaddr_un.sun_path (108 bytes on
# Linux); the longest name under the directory is "from_scheduler"
SOCKET_PATH_MAX = 107
LONGEST_SOCKET = "from_scheduler"
FALLBACK_TMP = "/tmp"
_IPC_DIR = re.compile(rf"{IPC_PREFIX}(\d+)-")  # baton-ipc-<owner pid>-<random>


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits. Call it in the child
    (a `preexec_fn`, or first thing in a spawned process). With `parent` (the pid the parent
    had), a parent that died before the request was made is caught too: `sig` at once."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(sig))
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def make_ipc_dir(root: str | None = None) -> str:
    """A fresh private directory for this process's IPC sockets, named after its pid, in the
    temp dir (`root`: another), or in /tmp where that is too deep for a socket's path (a deep
    $TMPDIR: a test runner's, a job's); the directories of dead owners (a SIGKILLed
    `baton serve` cleans nothing) are removed first."""
    root = root or tempfile.gettempdir()
    longest = len(os.path.join(root, f"{IPC_PREFIX}{os.getpid()}-{'x' * 8}", LONGEST_SOCKET))
    if longest > SOCKET_PATH_MAX:
        log.info("the temp dir %s is too deep for IPC socket paths: using %s", root, FALLBACK_TMP)
        root = FALLBACK_TMP
    clean_stale_ipc_dirs(root)
    return tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-", dir=root)


def clean_stale_ipc_dirs(root: str | None = None) -> list[Path]:
    """Remove our IPC directories under `root` (the temp dir) whose owner process is gone."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{IPC_PREFIX}*"):
        found = _IPC_DIR.match(path.name)
        if found is None or not path.is_dir() or path.stat().st_uid != os.getuid():
            continue
        owner = int(found.group(1))
        if owner == os.getpid() or not pid_alive(owner):  # our pid, not yet ours: a past life
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed the stale IPC directory %s (its server is gone)", path)
            removed.append(path)
    return removed
