"""`baton operator` as its own process (the console script's entry point, `runtime.cli`),
started with its liveness endpoint up and stopped with SIGTERM, which must end it cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from tests.kube.isvc_helpers import wait_for
from tests.ports import free_port


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@contextmanager
def running_operator(flags: list[str], log: Path, env: Mapping[str, str] | None = None,
                     liveness_port: int | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """`baton operator FLAGS --liveness=<liveness_port or a free port>`; on exit: SIGTERM,
    exit code 0 and no traceback in its log, or AssertionError with the log."""
    liveness = f"http://127.0.0.1:{liveness_port or free_port()}/healthz"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.cli", "operator", *flags, f"--liveness={liveness}"],
            env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: healthy(liveness) or proc.poll() is not None, 30, "operator liveness")
        assert proc.poll() is None, log.read_text()
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        text = log.read_text()
        assert code == 0, text
        assert "Traceback" not in text, text
