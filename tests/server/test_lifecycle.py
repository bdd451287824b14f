"""Process life cycle: SIGTERM drains and exits 0; bad flags exit 2 before anything starts."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.server_process import BATON, REPO, free_port, start_server


def test_unknown_role_is_rejected() -> None:
    r = subprocess.run([str(BATON), "serve", "--role", "router"], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    assert r.returncode == 2 and "--role" in r.stderr


def test_bad_flag_value_is_rejected() -> None:
    r = subprocess.run([str(BATON), "serve", "--stream-interval", "0"], capture_output=True,
                       text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2 and "--stream-interval" in r.stderr


def test_scheduler_failure_exits_nonzero_with_the_reason(tmp_path: Path) -> None:
    r = subprocess.run(
        [str(BATON), "serve", "--port", str(free_port()), "--sampler-backend", "no-such-sampler"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert r.returncode == 1
    assert "unknown sampler backend" in r.stderr and "scheduler process exited" in r.stderr


def test_sigterm_aborts_in_flight_after_grace_and_exits_zero(tmp_path: Path) -> None:
    srv = start_server("--shutdown-grace-s", "2", log_path=tmp_path / "server.log")
    chunks: list[dict] = []  # type: ignore[type-arg]
    first = threading.Event()

    def stream() -> None:
        body = {"text": "Count to one thousand:", "stream": True,
                "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}}
        with httpx.Client(base_url=srv.url, timeout=120) as c, c.stream("POST", "/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    first.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert first.wait(60), srv.log()
    began = time.monotonic()
    srv.terminate()
    time.sleep(0.5)
    with pytest.raises(httpx.HTTPError):  # no longer accepting
        httpx.post(f"{srv.url}/generate", json={"text": "hi"}, timeout=5).raise_for_status()
    code = srv.stop(timeout=60)
    t.join(30)
    assert code == 0, srv.log()
    assert time.monotonic() - began < 40
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort", chunks[-1]
    assert sum(len(c["output_ids"]) for c in chunks) < 3000
