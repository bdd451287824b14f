"""Start `baton serve` as a real subprocess on a free loopback port and stop it with SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from runtime.launch import sharing_cores
from runtime.lifecycle import die_with_parent
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
BATON = Path(sys.executable).parent / "baton"
# Where the project is not installed (the lent GPU machine runs it from PYTHONPATH): the module.
BATON_CMD = [str(BATON)] if BATON.exists() else [sys.executable, "-m", "runtime.cli"]
MODEL = "builtin:smollm2-135m"
START_TIMEOUT_S = 180.0


def _die_with_parent() -> None:
    """In the child: SIGKILL when the test process dies, so no server outlives a killed run."""
    die_with_parent(signal.SIGKILL)


class ServerProcess:
    """`baton serve` in its own process group (`kill()` takes the scheduler child too)."""

    def __init__(
        self, *extra_args: str, log_path: Path, model: str = MODEL, port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        # several servers share this machine's cores in most tests, as under `baton up`
        env = sharing_cores(dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1",
                                 TOKENIZERS_PARALLELISM="false", **(env or {})))
        cmd = [*BATON_CMD, "serve", "--model", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--max-total-tokens", "4096", *extra_args]
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env=env, start_new_session=True, preexec_fn=_die_with_parent)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"server not ready in {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def scheduler_pid(self) -> int:
        """The scheduler process (multiprocessing spawn's child of the HTTP process)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in children:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
        raise AssertionError(f"no scheduler process under {self.proc.pid}: {children}")

    def kill(self) -> None:
        """SIGKILL the whole server (HTTP and scheduler processes) at once."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait; returns the exit code (kills it if it does not exit in time)."""
        self.terminate()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(10)
            raise AssertionError(f"server ignored SIGTERM for {timeout} s:\n{self.log()}") from None
        finally:
            self._log.close()
        return code


def start_server(*extra_args: str, log_path: Path, **kwargs: Any) -> ServerProcess:
    server = ServerProcess(*extra_args, log_path=log_path, **kwargs)
    server.wait_ready()
    return server
