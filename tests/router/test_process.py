"""`baton router` as a real process: the console script, real DNS for `localhost`, SIGTERM."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx

from tests.ports import free_port
from tests.router.router_process import BATON, start_router


def test_baton_router_serves_static_workers_and_exits_0_on_sigterm(
        workers: Any, tmp_path: Path) -> None:
    p, d = workers("prefill", bootstrap_port=9123), workers("decode")
    router = start_router("--prefill", p.arg, "--decode", d.arg, "--policy", "least_load",
                          log_path=tmp_path / "router.log")
    try:
        with httpx.Client(base_url=router.url, timeout=10, trust_env=False) as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "stream": True}
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = [line for line in r.iter_lines() if line]
            assert r.status_code == 200 and lines[-1] == "data: [DONE]"
            assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["delta"]
            assert p.generation().body["bootstrap_port"] == 9123
            assert 'baton_router_requests_total{endpoint="/v1/chat/completions",status="200"}' \
                in client.get("/metrics").text
    finally:
        assert router.stop() == 0, router.log()


def test_dns_mode_resolves_localhost_for_real(workers: Any, tmp_path: Path) -> None:
    p, d = workers("prefill"), workers("decode")
    router = start_router("--prefill-dns", f"localhost:{p.server.port}:8998",
                          "--decode-dns", f"localhost:{d.server.port}",
                          log_path=tmp_path / "router.log")
    try:
        answer = httpx.post(f"{router.url}/generate", json={"text": "x"}, timeout=10,
                            trust_env=False)
        assert answer.status_code == 200, answer.text
        assert p.generation().body["bootstrap_host"] == "127.0.0.1"
    finally:
        assert router.stop() == 0, router.log()


def test_bad_flags_exit_2_with_a_message() -> None:
    port = str(free_port())
    done = subprocess.run([str(BATON), "router", "--port", port, "--decode", "http://d:1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "no prefill workers" in done.stderr
