"""`baton up` as a real subprocess, and the process-tree checks its tests use."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.ports import free_port
from tests.server.server_process import REPO

READY_S = 300


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(pid)
    return out


class Up:
    def __init__(self, model: str | Path, log_dir: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "runtime.cli", "up", "--model", str(model), "--port",
               str(self.port), "--log-dir", str(log_dir), *args]
        self.out = open(log_dir / "up.out", "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.out, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONPATH=str(REPO)))
        self.log_dir = log_dir

    def text(self) -> str:
        return (self.log_dir / "up.out").read_text(errors="replace")

    def wait_up(self) -> None:
        deadline = time.monotonic() + READY_S
        while "baton is up" not in self.text():
            assert self.proc.poll() is None, f"baton up exited early:\n{self.text()}"
            assert time.monotonic() < deadline, f"not up in {READY_S} s:\n{self.text()}"
            time.sleep(0.25)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.out.close()
