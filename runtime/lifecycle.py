"""Process hygiene: every process baton starts ends when its parent does.

Linux's parent-death signal covers a parent that is SIGKILLed (no cleanup code runs then);
elsewhere `die_with_parent` does nothing and the parent's own shutdown must do the work.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent exits. Call it in the child
    (a `preexec_fn`, or first thing in a spawned process)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(sig))
