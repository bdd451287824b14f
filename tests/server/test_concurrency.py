"""64 concurrent streaming clients; client disconnect and /abort free the request's KV."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from typing import Any

import httpx

from tests.server.server_process import ServerProcess

CLIENTS = 64
MAX = 8


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _requests_total(text: str) -> float:
    return sum(float(v) for v in re.findall(r"^baton_requests_total\{[^}]*\} (\S+)$", text, re.M))


def _wait_idle(client: httpx.Client, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        stats: dict[str, Any] = client.get("/debug/stats").json()
        if stats["kv_all_free"] and stats["kv_used_pages"] == 0 and stats["inflight"] == 0:
            return stats
        assert time.monotonic() < deadline, f"server not idle: {stats}"
        time.sleep(0.1)


async def _one_stream(client: httpx.AsyncClient, i: int) -> tuple[str, int, str | None]:
    body = {"model": "smollm2", "prompt": f"Request {i}: the number after {i} is", "max_tokens": MAX,
            "temperature": 0.8, "seed": i, "stream": True, "stream_options": {"include_usage": True}}
    text, usage, finish = "", -1, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line[6:])
        for choice in chunk["choices"]:
            text += choice["text"]
            finish = choice["finish_reason"] or finish
        if chunk.get("usage"):
            usage = chunk["usage"]["completion_tokens"]
    return text, usage, finish


def test_64_concurrent_streams_finish_and_free_kv(server: ServerProcess, client: httpx.Client) -> None:
    _wait_idle(client)
    before = client.get("/metrics").text

    async def run() -> list[tuple[str, int, str | None]]:
        limits = httpx.Limits(max_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as c:
            return await asyncio.gather(*(_one_stream(c, i) for i in range(CLIENTS)))

    results = asyncio.run(run())
    for _text, usage, finish in results:
        assert finish in ("length", "stop") and 1 <= usage <= MAX
        assert usage == MAX or finish == "stop"
    _wait_idle(client)
    after = client.get("/metrics").text
    assert _requests_total(after) - _requests_total(before) == CLIENTS
    generated = _metric(after, "baton_generation_tokens_total") - _metric(before, "baton_generation_tokens_total")
    assert generated == sum(u for _, u, _ in results)
    ttft_count = _metric(after, "baton_time_to_first_token_seconds_count") - _metric(before, "baton_time_to_first_token_seconds_count")
    assert ttft_count == CLIENTS
    assert _metric(after, "baton_kv_used_tokens") == 0
    assert _metric(after, "baton_running_requests") == 0 and _metric(after, "baton_queue_depth") == 0


def _long_body(rid: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"text": "Write a very long story:", "stream": True,
                            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}}
    if rid:
        body["rid"] = rid
    return body


def test_client_disconnect_aborts_and_frees_kv(server: ServerProcess, client: httpx.Client) -> None:
    _wait_idle(client)
    before = _metric(client.get("/metrics").text, "baton_requests_total", '{status="abort"}')
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/generate", json=_long_body()) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 6:
                break  # walk away mid-stream
    assert client.get("/debug/stats").json()["kv_used_pages"] >= 0
    _wait_idle(client)
    after = _metric(client.get("/metrics").text, "baton_requests_total", '{status="abort"}')
    assert after == before + 1


def test_abort_endpoint_ends_the_stream(server: ServerProcess, client: httpx.Client) -> None:
    _wait_idle(client)
    chunks = []
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/generate", json=_long_body("abort-me")) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks.append(json.loads(line[6:]))
            if len(chunks) == 3:
                assert client.post("/abort", json={"rid": "abort-me"}).json() == {"rid": "abort-me", "aborted": True}
    reason = chunks[-1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "abort" in reason["message"]
    assert client.post("/abort", json={"rid": "abort-me"}).json()["aborted"] is False
    _wait_idle(client)


def test_non_streaming_client_disconnect_aborts(server: ServerProcess, client: httpx.Client) -> None:
    _wait_idle(client)
    before = _metric(client.get("/metrics").text, "baton_requests_total", '{status="abort"}')
    body = _long_body()
    body["stream"] = False
    with contextlib.suppress(httpx.TimeoutException):  # the client gives up, closes the connection
        httpx.post(f"{server.url}/generate", json=body, timeout=1.5)
    _wait_idle(client)
    after = _metric(client.get("/metrics").text, "baton_requests_total", '{status="abort"}')
    assert after == before + 1
