"""Start `baton router ...` as a real subprocess on a free loopback port, wait for /ready.

For tests through real workers too:
    router = start_router("--prefill", f"{p.url},{p_bootstrap}", "--decode", d.url,
                          log_path=tmp_path / "router.log")
    ... httpx.post(f"{router.url}/v1/completions", ...) ...
    assert router.stop() == 0
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
BATON = Path(sys.executable).parent / "baton"
FAST = ("--health-interval-s", "0.2", "--health-timeout-s", "2", "--dns-refresh-s", "0.2",
        "--shutdown-grace-s", "2")  # test-speed defaults; later flags win


class RouterProcess:
    def __init__(self, *args: str, log_path: Path, fast: bool = True,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
        cmd = [str(BATON), "router", "--host", "127.0.0.1", "--port", str(self.port),
               *(FAST if fast else ()), *args]
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env=env)

    def wait_ready(self, timeout: float = 30.0) -> RouterProcess:
        """Until GET /ready is 200 (a prefill and a decode worker are ready)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"router not ready in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait; the exit code (killed, and an AssertionError, if it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"router ignored SIGTERM for {timeout} s:\n{self.log()}") from None
        finally:
            self._log.close()


def start_router(*args: str, log_path: Path, ready: bool = True,
                 env: dict[str, str] | None = None) -> RouterProcess:
    router = RouterProcess(*args, log_path=log_path, env=env)
    return router.wait_ready() if ready else router
