"""The router's own endpoints: /health, /ready, /metrics, /v1/models, and bad input."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from runtime.router.health import HealthChecker
from runtime.router.metrics import RouterMetrics
from runtime.router.workers import Worker, Workers
from tests.router.conftest import RouterThread, wait_for
from tests.router.fake_worker import FakeWorker

PD = tuple[RouterThread, FakeWorker, FakeWorker]


def sample(metrics: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample (0 when absent)."""
    for line in metrics.splitlines():
        m = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return 0.0


def test_ready_flips_with_worker_readiness(workers: Any, router: Any) -> None:
    p, d = workers("prefill"), workers("decode")
    r = router([p], [d])
    assert r.client.get("/ready").json()["ready_workers"] == {"prefill": 1, "decode": 1}
    d.ready = False
    wait_for(lambda: r.client.get("/ready").status_code == 503, what="/ready 503")
    error = r.client.get("/ready").json()["error"]
    assert error["code"] == "not_ready" and "decode" in error["message"]
    assert "no ready prefill" not in error["message"]
    assert r.client.get("/health").status_code == 200  # alive, just not ready
    answer = r.client.post("/generate", json={"text": "x"})
    assert answer.status_code == 503 and "no ready decode worker" in answer.json()["error"]["message"]
    assert not d.received  # an unready worker gets no requests
    p.ready = False
    wait_for(lambda: "prefill" in r.client.get("/ready").json()["error"]["message"])
    p.ready = d.ready = True
    r.wait_ready()
    assert r.client.post("/generate", json={"text": "x"}).status_code == 200


def test_no_workers_at_all_is_503(workers: Any, router: Any) -> None:
    p, d = workers("prefill"), workers("decode")
    p.ready = d.ready = False
    r = router([p], [d], ready=False)
    wait_for(lambda: 'baton_router_workers{role="decode"} 1.0' in r.metrics())
    bodies = {"/generate": {"text": "x"}, "/v1/completions": {"model": "m", "prompt": "x"},
              "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "x"}]}}
    for path, body in bodies.items():
        answer = r.client.post(path, json=body)
        assert answer.status_code == 503
        assert answer.json()["error"] == {
            "message": "no ready prefill and no ready decode worker (known: 1 prefill, 1 decode)",
            "type": "service_unavailable", "code": "no_ready_workers", "param": None}
    assert r.client.get("/v1/models").status_code == 503


@pytest.mark.parametrize(("raw", "why"), [
    (b"{not json", "malformed JSON"),
    (b"[1, 2]", "not an array"),
    (b'"text"', "not a string"),
    (b"", "malformed JSON"),
    (b"\xff\xfe", "malformed JSON"),
    (b'{"text": NaN}', "NaN"),
    (b"[" * 100000, "malformed JSON"),
])
def test_a_body_that_is_not_a_json_object_is_400(pd: PD, raw: bytes, why: str) -> None:
    router, p, _ = pd
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        answer = router.client.post(path, content=raw,
                                    headers={"content-type": "application/json"})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "code", "param"}
        assert error["code"] == "json_invalid" and why in error["message"]
    assert not p.received


def test_bad_routing_fields_are_400(pd: PD) -> None:
    router, p, _ = pd
    answer = router.client.post("/generate", json={"text": "x", "rid": 5})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "rid"
    answer = router.client.post("/v1/completions", json={"model": "m", "prompt": "x", "n": 10**9})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "n"
    # checked as a worker checks it (tests/router/test_validation.py has the whole table)
    answer = router.client.post("/v1/completions", json={"model": "m", "prompt": "x", "n": "3"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "n"
    assert not p.received
    # what needs the model (its name, its context) is the workers' to judge: passed on
    answer = router.client.post("/v1/completions", json={"model": "any", "prompt": "x"})
    assert answer.status_code == 200 and p.generation().body["model"] == "any"


def test_unknown_paths_and_methods_are_json_errors(pd: PD) -> None:
    router, _, _ = pd
    answer = router.client.get("/nope")
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"
    answer = router.client.get("/generate")
    assert answer.status_code == 405 and answer.json()["error"]["code"] == "method_not_allowed"


def test_models_come_from_a_ready_decode_worker(pd: PD) -> None:
    router, _, _ = pd
    answer = router.client.get("/v1/models")
    assert answer.status_code == 200 and answer.json()["data"][0]["id"] == "fake-decode"


def test_models_come_from_another_decode_when_the_first_one_died(workers: Any, router: Any) -> None:
    """The decode the router would ask first died before a health check noticed: the list of
    models comes from the next one, not a 502."""
    p, d1, d2 = workers("prefill"), workers("decode"), workers("decode")
    r = router([p], [d1, d2], "--health-interval-s", "30")
    d1.server.server.should_exit = True
    d1.stop()
    for _ in range(4):
        answer = r.client.get("/v1/models")
        assert answer.status_code == 200 and answer.json()["data"][0]["id"] == "fake-decode"


def test_metrics_count_requests_failures_workers_and_latency(pd: PD) -> None:
    router, p, d = pd
    for _ in range(3):
        assert router.client.post("/generate", json={"text": "x"}).status_code == 200
    router.client.post("/v1/completions", content=b"[]",
                       headers={"content-type": "application/json"})
    router.client.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "x"}],
        "fake": {"decode": {"status": 400}}})
    m = router.metrics()
    assert sample(m, "baton_router_requests_total", endpoint="/generate", status="200") == 3
    assert sample(m, "baton_router_requests_total", endpoint="/v1/completions",
                  status="400") == 1
    assert sample(m, "baton_router_requests_total", endpoint="/v1/chat/completions",
                  status="400") == 1
    assert sample(m, "baton_router_upstream_failures_total", side="decode",
                  reason="status") == 1
    assert sample(m, "baton_router_ready_workers", role="prefill") == 1
    assert sample(m, "baton_router_ready_workers", role="decode") == 1
    assert sample(m, "baton_router_request_latency_seconds_count", endpoint="/generate") == 3
    for worker in (p, d):  # a prefill call may end after the client got the decode's answer
        wait_for(lambda w=worker: sample(router.metrics(), "baton_router_worker_in_flight",
                                         worker=w.url) == 0, what=f"{worker.url} idle")


def test_abort_goes_to_every_worker(pd: PD) -> None:
    router, p, d = pd
    answer = router.client.post("/abort", json={"rid": "mine"})
    assert answer.status_code == 200 and answer.json() == {"rid": "mine", "sent_to": 2}
    wait_for(lambda: "mine" in p.aborts and "mine" in d.aborts, what="aborts")
    for bad in (b"[]", b'{"rid": 3}', b"{}"):
        answer = router.client.post("/abort", content=bad,
                                    headers={"content-type": "application/json"})
        assert answer.status_code == 400
    assert router.client.post("/abort", content=b'{"rid": "x"}').status_code == 415


async def test_a_worker_that_stops_answering_is_out_after_n_polls(workers: Any) -> None:
    w = workers("decode")
    worker = Worker("decode", w.url)
    async with httpx.AsyncClient(trust_env=False) as client:
        health = HealthChecker(client, Workers(), RouterMetrics(), interval=1, timeout=0.1,
                               failures=2)
        await health.check([worker])
        assert worker.ready
        w.ready_delay_s = 0.5
        await health.check([worker])
        assert worker.ready  # one unanswered poll is not enough
        await health.check([worker])
        assert not worker.ready and worker.unanswered == 2
        w.ready_delay_s = 0
        await health.check([worker])
        assert worker.ready and worker.unanswered == 0
        w.ready = False
        await health.check([worker])
        assert not worker.ready  # a worker that says it is not ready is out at once
        w.stop()
        w.ready = True
        await health.check([worker])
        assert not worker.ready  # so is one that refuses the connection
