"""/ready means the scheduler makes progress: a worker whose scheduler process is frozen answers
/ready 503 (code `stalled`) once it has been silent for --stall-timeout-s, so a router takes it
out, and 200 again when it speaks; /health (the process is up) stays 200 meanwhile."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from tests.server.server_process import ServerProcess


def _until(check, timeout: float, what: str) -> float:  # type: ignore[no-untyped-def]
    began = time.monotonic()
    while not check():
        assert time.monotonic() - began < timeout, f"not reached in {timeout} s: {what}"
        time.sleep(0.1)
    return time.monotonic() - began


def test_ready_turns_503_while_the_scheduler_is_frozen(tiny_path: Path, tmp_path: Path) -> None:
    srv = ServerProcess("--stall-timeout-s", "1.5", model=str(tiny_path),
                        log_path=tmp_path / "server.log")
    try:
        srv.wait_ready()
        time.sleep(3)  # idle: it still speaks every second, so it stays ready
        assert httpx.get(f"{srv.url}/ready").status_code == 200
        pid = srv.scheduler_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            took = _until(lambda: httpx.get(f"{srv.url}/ready").status_code == 503, 10, "503")
            answer = httpx.get(f"{srv.url}/ready").json()["error"]
            assert answer["code"] == "stalled" and "silent" in answer["message"], answer
            assert took < 4, took
            assert httpx.get(f"{srv.url}/health").status_code == 200
        finally:
            os.kill(pid, signal.SIGCONT)
        _until(lambda: httpx.get(f"{srv.url}/ready").status_code == 200, 10, "ready again")
        r = httpx.post(f"{srv.url}/generate", json={"text": "hi", "sampling_params": {
            "max_new_tokens": 2}}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        assert srv.stop() == 0, srv.log()
