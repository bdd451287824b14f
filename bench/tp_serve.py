"""`baton serve` for bench/tp.py: one server on a loopback port, a burst of streaming requests,
and an end that leaves nothing behind.

The server runs in this process's environment (OpenMP's defaults included, as a bare
`baton serve`), in a session of its own: its HTTP process, its scheduler and the scheduler's TP
followers share one process group, so whatever of it outlives a stop is found and killed by pid.
It also dies with this process (PDEATHSIG), so a killed bench leaves no server behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from runtime.lifecycle import die_with_parent

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    die_with_parent(signal.SIGKILL)


class Server:
    """`baton serve --model MODEL ARGS...`, ready on return (or ended, and RuntimeError raised
    with its log's tail). `end()` must follow, also on failure."""

    def __init__(self, model: Path, args: list[str], log_path: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "runtime.cli", "serve", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(self.port), *args]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                         env=env, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        try:
            self._wait_ready()
        except BaseException:
            self.end()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"baton serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"baton serve not ready in {READY_TIMEOUT_S:.0f} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def end(self, grace_s: float = 30.0) -> list[int]:
        """SIGTERM and a bounded wait (then SIGKILL); then SIGKILL, by pid, whatever of its
        process group (scheduler, TP followers) is still alive 5 s later. Returns those pids:
        none, when the server stops as it should."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        deadline = time.monotonic() + 5
        while (left := group_members(self.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return left


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out


async def stream(client: httpx.AsyncClient, ids: list[int],
                 sampling: dict[str, object]) -> tuple[float, list[int]]:
    """One streaming /generate: (seconds to the first chunk with a token, the output ids)."""
    body = {"input_ids": ids, "stream": True, "sampling_params": sampling}
    sent, first, out = time.perf_counter(), float("nan"), list[int]()
    async with client.stream("POST", "/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])["output_ids"]  # only the new ids
                if chunk and not out:
                    first = time.perf_counter() - sent
                out += chunk
    return first, out


def burst(url: str, prompts: list[list[int]], sampling: dict[str, object]
          ) -> tuple[float, list[tuple[float, list[int]]]]:
    """Every prompt at once: (wall seconds, each request's (TTFT, ids))."""

    async def all_at_once() -> tuple[float, list[tuple[float, list[int]]]]:
        limits = httpx.Limits(max_connections=len(prompts))
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            start = time.perf_counter()
            done = await asyncio.gather(*(stream(client, p, sampling) for p in prompts))
            return time.perf_counter() - start, list(done)

    return asyncio.run(all_at_once())
