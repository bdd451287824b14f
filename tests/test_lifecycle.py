"""Issue 12, item 3: the IPC directory a killed server left is removed at the next start, and
only that one (a live server's, or a name that is not ours, stays)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from runtime.lifecycle import IPC_PREFIX, clean_stale_ipc_dirs


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_only_the_ipc_dirs_of_dead_owners_are_removed(tmp_path: Path) -> None:
    dead = tmp_path / f"{IPC_PREFIX}{_dead_pid()}-abc"
    mine = tmp_path / f"{IPC_PREFIX}{os.getpid()}-abc"  # a past life of a pid reused by us
    live = tmp_path / f"{IPC_PREFIX}{os.getppid()}-abc"
    other = tmp_path / f"{IPC_PREFIX}abc"  # not named after a pid: not known to be stale
    for d in (dead, mine, live, other):
        d.mkdir()
        (d / "to_scheduler").touch()
    assert sorted(clean_stale_ipc_dirs(str(tmp_path))) == sorted([dead, mine])
    assert not dead.exists() and not mine.exists() and live.exists() and other.exists()
