"""/ready means the scheduler makes progress: a worker whose scheduler process is frozen answers
/ready 503 (code `stalled`) once it has been silent for --stall-timeout-s, so a router takes it
out, and 200 again when it speaks; /health (the process is up) stays 200 meanwhile."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

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


async def _stream(http: httpx.AsyncClient, url: str, body: dict[str, Any], seen: list[int]) -> list[dict[str, Any]]:
    """Every JSON event of a 200 stream, counting its tokens in `seen` as they come."""
    got = []
    async with http.stream("POST", url, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                got.append(json.loads(line[6:]))
                seen[0] += len(got[-1].get("output_ids") or got[-1].get("choices", [{}])[0].get("token_ids") or [1])
    return got


@pytest.mark.parametrize("death", ["killed", "step-fails"])
def test_a_dead_scheduler_fails_its_requests_it_does_not_finish_them(
        tiny_path: Path, tmp_path: Path, death: str) -> None:
    """The scheduler process dies mid-stream, by kill -9 or by a step that raises (a bug, or a
    failed collective when a TP rank is gone): each stream gets an error event after its
    tokens (never a finish_reason, which a router would pass on as a short answer), a request
    with no response yet a 503, and the server exits 1."""
    failing = (("--plugin", "tests.server.failing_step", "--attention-backend", "failing-step")
               if death == "step-fails" else ())
    srv = ServerProcess("--served-model-name", "tiny", *failing, model=str(tiny_path),
                        log_path=tmp_path / "server.log", env={"BATON_TEST_FAIL_AFTER_STEPS": "40"})
    srv.wait_ready()
    sampling = {"temperature": 0, "max_new_tokens": 4000, "ignore_eos": True}
    native = {"text": "hello", "stream": True, "sampling_params": sampling}
    openai = {"model": "tiny", "prompt": "hello", "stream": True, "max_tokens": 4000,
              "temperature": 0, "ignore_eos": True}
    seen = [[0], [0]]

    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]], httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as http:
            streams = [asyncio.ensure_future(_stream(http, f"{srv.url}/generate", native, seen[0])),
                       asyncio.ensure_future(_stream(http, f"{srv.url}/v1/completions", openai, seen[1]))]
            whole = asyncio.ensure_future(http.post(f"{srv.url}/generate", json={
                "text": "hi", "sampling_params": sampling}))
            deadline = time.monotonic() + 30
            while min(s[0] for s in seen) < 5:
                assert time.monotonic() < deadline and not any(s.done() for s in streams), seen
                await asyncio.sleep(0.01)
            if death == "killed":
                os.kill(srv.scheduler_pid(), signal.SIGKILL)
            a, b = await asyncio.gather(*streams)
            return a, b, await whole

    try:
        native_events, openai_events, whole = asyncio.run(run())
        for got in (native_events, openai_events):
            assert got[-1]["error"]["code"] == "stream_failed", got[-3:]
            assert "scheduler process exited" in got[-1]["error"]["message"]
            assert not [e for e in got[:-1] if "error" in e or _finished(e)], got[-3:]
        assert whole.status_code == 503, whole.text
        assert srv.proc.wait(30) == 1
    finally:
        if srv.proc.poll() is None:
            srv.kill()


def _finished(event: dict[str, Any]) -> bool:
    choices = event.get("choices") or [{}]
    return bool((event.get("meta_info") or {}).get("finish_reason") or choices[0].get("finish_reason"))
