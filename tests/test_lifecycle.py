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


def test_a_temp_dir_too_deep_for_socket_paths_falls_back_to_tmp(tmp_path: Path) -> None:
    """A deep $TMPDIR (a test runner's worker folder, a CI job's) would make the sockets'
    paths longer than a sockaddr_un holds, and the server fail at start: the sockets go to /tmp
    then, and a socket binds there."""
    import shutil
    import socket
    import tempfile

    from runtime.lifecycle import LONGEST_SOCKET, SOCKET_PATH_MAX, make_ipc_dir

    short_root = Path(tempfile.mkdtemp(prefix="ipc-", dir="/tmp"))
    shallow = make_ipc_dir(str(short_root))
    deep_root = tmp_path / ("d" * 60) / ("e" * 60)
    deep_root.mkdir(parents=True)
    deep = make_ipc_dir(str(deep_root))
    try:
        assert Path(shallow).parent == short_root
        assert Path(deep).parent == Path("/tmp") and Path(deep).name.startswith(IPC_PREFIX)
        path = os.path.join(deep, LONGEST_SOCKET)
        assert len(path) <= SOCKET_PATH_MAX < len(str(deep_root / Path(deep).name / LONGEST_SOCKET))
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(path)
    finally:
        shutil.rmtree(deep, ignore_errors=True)
        shutil.rmtree(short_root, ignore_errors=True)
