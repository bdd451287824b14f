"""Issue 12, item 5: TTFT is the first token's time whatever the client asked for, and
`baton_http_errors_total` counts every error response (and no probe answers)."""

from __future__ import annotations

import json
import re
import socket

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from runtime.figures import ServingFigures
from runtime.messages import SchedulerStats
from runtime.server.metrics import Metrics
from runtime.server.middleware import ErrorGuard
from tests.router.server_thread import ServerThread
from tests.server.server_process import ServerProcess
from tests.server.test_concurrency import _wait_idle
from tests.server.test_hostile_input import exchange


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


TTFT, ITL, E2E = ("baton_time_to_first_token_seconds", "baton_inter_token_latency_seconds",
                  "baton_e2e_request_latency_seconds")
TOKENS = 24


@pytest.mark.parametrize(("path", "extra"), [
    ("/v1/completions", {"prompt": "Once upon a time"}),
    ("/v1/completions", {"prompt": "Once upon a time", "stream": True, "stream_interval": 8}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story."}]}),
], ids=["non-streaming", "stream-interval-8", "chat-non-streaming"])
def test_ttft_is_the_first_token_and_the_rest_are_inter_token(
        server: ServerProcess, client: httpx.Client, path: str, extra: dict[str, object]) -> None:
    _wait_idle(client)
    before = client.get("/metrics").text
    body = {"model": "smollm2", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, **extra}
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    after = client.get("/metrics").text

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert delta(f"{TTFT}_count") == 1
    assert delta(f"{ITL}_count") == TOKENS - 1  # one sample per token after the first
    ttft, e2e = delta(f"{TTFT}_sum"), delta(f"{E2E}_sum")
    assert 0 < ttft < e2e, (ttft, e2e)
    assert delta(f"{ITL}_sum") > 0


def test_http_errors_are_counted_by_status(server: ServerProcess, client: httpx.Client) -> None:
    def errors(status: int) -> float:
        return metric(client.get("/metrics").text, "baton_http_errors_total",
                      f'{{status="{status}"}}')

    before = {s: errors(s) for s in (400, 404, 405, 413, 415)}
    assert client.get("/v1/nope").status_code == 404
    assert client.get("/v1/completions").status_code == 405
    big = b'{"model": "smollm2", "prompt": "' + b"a" * (2 << 20) + b'"}'
    assert client.post("/v1/completions", content=big,
                       headers={"content-type": "application/json"}).status_code == 413
    assert client.post("/v1/completions", content=b"{}",
                       headers={"content-type": "text/plain"}).status_code == 415
    assert client.post("/v1/completions", json={"model": "smollm2"}).status_code == 400
    assert {s: errors(s) - before[s] for s in before} == {400: 1, 404: 1, 405: 1, 413: 1, 415: 1}
    assert client.get("/ready").status_code == 200 and client.get("/health").status_code == 200


async def _crash(scope: Scope, receive: Receive, send: Send) -> None:
    """An app with a bug: every request raises before it answers."""
    raise RuntimeError("a bug")


def test_an_unhandled_error_is_a_counted_json_500_on_a_connection_that_survives() -> None:
    metrics = Metrics()
    server = ServerThread(ErrorGuard(_crash, metrics=metrics)).start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            for _ in range(2):  # the second goes over the same keep-alive connection
                status, headers, body = exchange(sock, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                assert status == 500 and headers.get("connection") != "close", headers
                assert json.loads(body)["error"]["message"] == "internal error: a bug"
    finally:
        server.stop()
    assert metric(metrics.render().decode(), "baton_http_errors_total", '{status="500"}') == 2


def test_retractions_are_counted_from_the_scheduler_total() -> None:
    metrics = Metrics()
    for total in (0, 3, 3, 5):
        metrics.set_stats(SchedulerStats(retractions=total))
    assert metric(metrics.render().decode(), "baton_retractions_total") == 5


def test_the_planner_figures_are_counted_from_the_scheduler_totals() -> None:
    metrics, figures = Metrics(), ServingFigures()
    for prompt, output in ((5, 3), (7, 4)):
        figures.received += 1
        figures.prompts.add(prompt)
        figures.outputs.add(output)
        figures.forwards["extend"].add(prompt, 0.5)
        figures.forwards["decode"].add(2, 0.25)
        metrics.set_stats(SchedulerStats(figures=figures.since(ServingFigures())))
        metrics.set_stats(SchedulerStats(figures=figures.since(ServingFigures())))  # no rise
    text = metrics.render().decode()
    assert metric(text, "baton_planner_received_total") == 2
    assert [metric(text, f"baton_planner_prompt{s}_total") for s in ("s", "_tokens",
                                                                      "_tokens_squared")] == [2, 12, 74]
    assert metric(text, "baton_planner_output_tokens_squared_total") == 25
    assert metric(text, "baton_forwards_total", '{mode="extend"}') == 2
    assert metric(text, "baton_forward_tokens_total", '{mode="extend"}') == 12
    assert metric(text, "baton_forward_tokens_total", '{mode="decode"}') == 4
    assert metric(text, "baton_forward_seconds_total", '{mode="decode"}') == 0.5
