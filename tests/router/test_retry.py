"""Failures the client never sees (docs/router.md "Failures"), through a real router over real
HTTP: retries before the first byte on another pair, health per (prefill, decode) pair, one
request per client rid, and a status that matches what the client got."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from tests.router.conftest import RouterThread, wait_for
from tests.router.fake_worker import FakeWorker
from tests.router.test_proxy import BODIES, events, sse

GEN = {"text": "Hello", "sampling_params": {"max_new_tokens": 4}}
# a real D answers only once P's KV arrived, so never before P's failure: a stand-in D waits
SLOW_D = {"fake": {"decode": {"delay_s": 0.3}}}


def gens(worker: FakeWorker) -> list[dict[str, Any]]:
    return [r.body for r in worker.received]


def metric(router: RouterThread, name: str) -> float:
    total = 0.0
    for line in router.metrics().splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.split()[-1])
    return total


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("failing", ["prefill-500", "prefill-gone", "decode-503", "decode-gone"])
def test_a_failure_before_the_answer_is_retried_on_another_pair(
        workers: Any, router: Any, stream: bool, failing: str) -> None:
    ps = [workers("prefill", bootstrap_port=9001), workers("prefill", bootstrap_port=9002)]
    ds = [workers("decode"), workers("decode")]
    r = router(ps, ds, "--policy", "round_robin", "--health-interval-s", "60")
    role, how = failing.split("-")
    bad = (ps if role == "prefill" else ds)[0]
    if how == "gone":
        bad.stop()
    else:
        bad.steer = {"status": int(how), "message": "worker broke"}
    body: dict[str, Any] = {**GEN, "rid": "client-rid", "stream": stream}
    if role == "prefill":
        body.update(SLOW_D)
    if stream:
        status, got = sse(r.client, "/generate", body)
        assert [e["meta_info"]["id"] for e in got[:-1]] == ["client-rid"] * 3
        assert got[-1] == "[DONE]"
    else:
        answer = r.client.post("/generate", json=body)
        status = answer.status_code
        assert answer.json()["meta_info"]["id"] == "client-rid"  # not the retry's rid
    assert status == 200
    # (a stand-in P may get its copy after D answered: wait for both)
    wait_for(lambda: {w.role for w in ps + ds if w.got("client-rid.retry1")} == {
        "prefill", "decode"}, what="the retry on both sides")
    retried = [w for w in ps + ds if w.got("client-rid.retry1")]
    assert bad not in retried and {w.role for w in retried} == {"prefill", "decode"}
    second = retried[1].generation("client-rid.retry1").body
    assert retried[0].generation("client-rid.retry1").body["bootstrap_room"] == \
        second["bootstrap_room"]
    if how != "gone":  # the first try went to the bad worker and, on the other side, was aborted
        first = bad.generation("client-rid").body
        assert first["bootstrap_room"] != second["bootstrap_room"]
        other = next(w for w in ps + ds if w.got("client-rid") and w is not bad)
        wait_for(lambda: "client-rid" in other.aborts, what="the first try's other side aborted")
        assert "client-rid" not in bad.aborts  # it answered: it holds nothing
    assert metric(r, "baton_router_retries_total") == 1
    assert 'endpoint="/generate",status="200"} 1.0' in r.metrics()


def test_every_try_failing_gives_one_clear_error(workers: Any, router: Any) -> None:
    ps = [workers("prefill", bootstrap_port=9001 + i) for i in range(2)]
    d = workers("decode")
    r = router(ps, [d], "--max-retries", "3", "--retry-backoff-s", "0.01")
    for p in ps:
        p.steer = {"status": 503, "message": "overloaded"}
    answer = r.client.post("/v1/completions", json={**BODIES["/v1/completions"], **SLOW_D})
    assert answer.status_code == 503 and answer.json()["error"]["message"] == "overloaded"
    sent = gens(ps[0]) + gens(ps[1])  # (D's copy may be cancelled before it arrives)
    assert len(sent) == 4  # the first try and 3 retries, each aborted on D
    rooms = {b["bootstrap_room"] for b in sent}
    rids = {b["rid"] for b in sent}
    assert len(rooms) == 4 and len(rids) == 4  # fresh rooms and rids each time
    wait_for(lambda: set(d.aborts) == rids, what="every try aborted on D")
    assert metric(r, "baton_router_retries_total") == 3
    assert 'status="503"} 1.0' in r.metrics()


@pytest.mark.parametrize("comes_back_s", [0.0, 0.6, None])
def test_a_retry_with_no_ready_pair_waits_for_one(workers: Any, router: Any,
                                                  comes_back_s: float | None) -> None:
    """Issue #34 item 7 (every stream 502 after a prefill kill, seen in CI): the other prefill
    was ready, but the router had not polled it since it came up (or it was starting again),
    and a retry that found no ready pair failed at once. Now the retry polls the workers that
    are out and waits for a pair, up to --retry-wait-s; past it the client gets the failure."""
    p0, p1 = workers("prefill", bootstrap_port=9001), workers("prefill", bootstrap_port=9002)
    d = workers("decode")
    p1.ready = False  # at the router's first poll; no other poll comes in this test
    r = router([p0, p1], [d], "--policy", "round_robin", "--health-interval-s", "60",
               "--retry-wait-s", "1.5")
    p1.ready = comes_back_s == 0  # ready now, but the router does not know it yet
    p0.stop()  # the only prefill the router sees ready is gone
    if comes_back_s:
        threading.Timer(comes_back_s, lambda: setattr(p1, "ready", True)).start()
    began = time.monotonic()
    answer = r.client.post("/generate", json={**GEN, "rid": "waits", **SLOW_D})
    took = time.monotonic() - began
    if comes_back_s is None:
        assert answer.status_code == 502 and answer.json()["error"]["code"] == "prefill_connect"
        assert 1.5 <= took < 4, took
        assert not p1.received
    else:
        assert answer.status_code == 200, answer.text
        assert p1.got("waits.retry1") and d.got("waits.retry1")
        assert took >= (comes_back_s or 0)
    assert metric(r, "baton_router_retries_total") == (comes_back_s is not None)


def test_a_client_error_is_not_retried(workers: Any, router: Any) -> None:
    ps = [workers("prefill", bootstrap_port=9001 + i) for i in range(2)]
    d = workers("decode")
    r = router(ps, [d])
    body = {**GEN, "fake": {"prefill": {"status": 400, "message": "prompt too long"},
                            "decode": {"delay_s": 0.3}}}
    answer = r.client.post("/generate", json=body)
    assert answer.status_code == 400 and answer.json()["error"]["message"] == "prompt too long"
    assert len(d.received) <= 1 and metric(r, "baton_router_retries_total") == 0
    assert sum(len(p.received) for p in ps) == 1


def test_no_retry_with_max_retries_zero(workers: Any, router: Any) -> None:
    ps = [workers("prefill", bootstrap_port=9001 + i) for i in range(2)]
    d = workers("decode")
    r = router(ps, [d], "--max-retries", "0", "--policy", "round_robin")
    ps[0].steer = {"status": 500, "message": "broke"}
    answer = r.client.post("/generate", json={**GEN, **SLOW_D})
    assert answer.status_code == 500
    assert metric(r, "baton_router_retries_total") == 0
    assert len(d.received) <= 1  # (P's failure may cancel the call to D before it arrives)
    assert not any(w.received for w in ps[1:])


def contents(path: str, got: list[Any]) -> list[str]:
    out = []
    for e in got:
        if isinstance(e, dict) and path == "/generate":
            out.append(e["text"])
        elif isinstance(e, dict) and e.get("choices"):
            c = e["choices"][0]
            out.append(c["text"] if path == "/v1/completions" else c["delta"]["content"])
    return out


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("how", ["die_after", "error_after"])
def test_a_broken_stream_goes_on_on_another_decode(workers: Any, router: Any, path: str,
                                                   how: str) -> None:
    """D dies (or reports an error) after 2 of 5 events: the client's stream simply goes on
    from another decode, each token once, one finish reason, the first stream's ids."""
    p = workers("prefill")
    ds = [workers("decode"), workers("decode")]
    r = router([p], ds, "--policy", "round_robin")
    ds[0].steer = {how: 2}
    body = {**BODIES[path], "stream": True, "fake": {"decode": {"chunks": 5}}}
    if path == "/generate":
        body["rid"] = "keep-me"
    status, got = sse(r.client, path, body)
    assert status == 200 and got[-1] == "[DONE]"
    assert not any("error" in e for e in got[:-1]), got
    assert contents(path, got) == [f"tok{i} " for i in range(5)]
    resumed = ds[1].generation().body
    assert resumed["resume"] == {"output_ids": [0, 1], "text_chars": len("tok0 tok1 ")}
    assert resumed["rid"] != ds[0].generation().body["rid"]
    assert resumed["bootstrap_room"] != ds[0].generation().body["bootstrap_room"]
    assert p.generation(resumed["rid"]).body["resume"] == resumed["resume"]  # P computes them too
    events_ = got[:-1]
    if path == "/generate":
        assert {e["meta_info"]["id"] for e in events_} == {"keep-me"}
        finishes = [e["meta_info"]["finish_reason"] for e in events_]
    else:
        assert len({(e["id"], e["created"]) for e in events_}) == 1
        assert all("token_ids" not in c for e in events_ for c in e["choices"])
        finishes = [e["choices"][0]["finish_reason"] for e in events_]
        if path == "/v1/chat/completions":
            assert [bool(e["choices"][0]["delta"].get("role")) for e in events_].count(True) == 1
    assert [f for f in finishes if f] in (["length"], [{"type": "length"}])
    assert metric(r, "baton_router_migrations_total") == 1
    assert 'status="200"} 1.0' in r.metrics()


def test_migrations_are_bounded_then_the_stream_ends_in_band(workers: Any, router: Any) -> None:
    p = workers("prefill")
    ds = [workers("decode"), workers("decode")]
    r = router([p], ds, "--policy", "round_robin", "--max-migrations", "1")
    ds[0].steer, ds[1].steer = {"die_after": 1}, {"die_after": 3}
    body = {**BODIES["/v1/completions"], "stream": True, "fake": {"decode": {"chunks": 5}}}
    status, got = sse(r.client, "/v1/completions", body)
    assert status == 200
    assert contents("/v1/completions", got) == ["tok0 ", "tok1 ", "tok2 "]
    assert got[3]["error"]["code"] == "decode_broken" and got[4:] == ["[DONE]"]
    assert metric(r, "baton_router_migrations_total") == 1


def test_streams_with_several_choices_are_not_followed(pd: Any) -> None:
    router, _, d = pd
    body = {**BODIES["/v1/chat/completions"], "stream": True, "n": 2}
    status, got = sse(router.client, "/v1/chat/completions", body)
    assert status == 200 and got[-1] == "[DONE]"
    assert "return_token_ids" not in d.generation().body
    plain = {**BODIES["/v1/chat/completions"], "stream": True}
    sse(router.client, "/v1/chat/completions", plain)
    assert d.generation().body["return_token_ids"] is True


def test_a_duplicate_rid_is_refused_and_the_original_untouched(pd: Any) -> None:
    router, p, d = pd
    body = {**GEN, "rid": "mine", "stream": True, "fake": {"decode": {"chunks": 3, "gated": True}}}
    with router.client.stream("POST", "/generate", json=body) as first:
        lines = first.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
        again = router.client.post("/generate", json={**GEN, "rid": "mine"})
        assert again.status_code == 409, again.text
        assert again.json()["error"]["code"] == "rid_in_use"
        assert again.json()["error"]["param"] == "rid"
        d.release(2)
        got = events([line for line in lines if line])
    assert [e["text"] for e in got[:-1]] == ["tok1 ", "tok2 "] and got[-1] == "[DONE]"
    assert d.aborts == [] and p.aborts == [] and len(d.received) == 1
    # once it finished, the rid is free again
    assert router.client.post("/generate", json={**GEN, "rid": "mine"}).status_code == 200


def test_router_abort_reaches_the_current_try(workers: Any, router: Any) -> None:
    ps = [workers("prefill", bootstrap_port=9001 + i) for i in range(2)]
    d = workers("decode")
    r = router(ps, [d], "--policy", "round_robin")
    ps[0].steer = {"status": 500}
    body = {**GEN, "rid": "to-abort", "fake": {"decode": {"hang": True}}}
    with httpx.Client(base_url=r.url, timeout=10, trust_env=False) as client:
        answers: list[httpx.Response] = []
        t = threading.Thread(target=lambda: answers.append(client.post("/generate", json=body)))
        t.start()
        wait_for(lambda: d.got("to-abort.retry1"), what="the retry on D")
        assert r.client.post("/abort", json={"rid": "to-abort"}).json()["sent_to"] == 2
        t.join(10)
    assert answers[0].status_code == 200
    assert answers[0].json()["meta_info"]["finish_reason"] == {"type": "abort"}
    assert "to-abort.retry1" in d.aborts


def test_a_client_that_hangs_up_after_done_is_no_499(pd: Any) -> None:
    """The request is delivered with its [DONE]: hanging up then aborts nothing."""
    router, p, d = pd
    body = {**BODIES["/v1/chat/completions"], "stream": True,
            "fake": {"decode": {"chunks": 2, "linger_s": 1.0}}}
    for _ in range(3):
        with router.client.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    break  # and hang up while D's stream is still open
    wait_for(lambda: 'status="200"} 3.0' in router.metrics(), what="3 requests counted 200")
    assert 'status="499"' not in router.metrics()
    assert d.aborts == [] and p.aborts == []


def test_a_broken_link_quarantines_its_pair_only(workers: Any, router: Any) -> None:
    """P0 cannot send KV to D0; both keep serving with their other partners, the pair is
    quarantined, probed back after its backoff, and healthy again once the link works."""
    ps = [workers("prefill", bootstrap_port=9001 + i) for i in range(2)]
    ds = [workers("decode"), workers("decode")]
    r = router(ps, ds, "--policy", "least_load", "--pair-failures", "2",
               "--pair-quarantine-s", "0.5", "--retry-backoff-s", "0.01")
    ds[0].broken_links = {9001}
    key = (ps[0].url, ds[0].url)

    def pair_state() -> str | None:
        for pair in r.client.get("/debug/pairs").json()["pairs"]:
            if (pair["prefill"], pair["decode"]) == key:
                return str(pair["state"])
        return None

    for i in range(16):
        answer = r.client.post("/generate", json={**GEN, "rid": f"q{i}"})
        assert answer.status_code == 200, answer.text  # every failure was retried
    assert pair_state() == "quarantined"
    assert f'baton_router_pair_state{{decode="{ds[0].url}",prefill="{ps[0].url}"}} 2.0' in r.metrics()
    # both workers of the pair kept serving with their other partners
    ok = [(b["bootstrap_port"], ds.index(w)) for w in ds for b in gens(w)]
    assert (9001, 1) in ok and (9002, 0) in ok, ok
    failed = metric(r, "baton_router_retries_total")
    assert 2 <= failed <= 4  # the pair failed its threshold, maybe a probe: no more
    ds[0].broken_links = set()  # the link heals
    wait_for(lambda: pair_state() == "probing", timeout=5, what="the quarantine to pass")
    for i in range(2):  # P0 gets one of them, and its pair due for a probe gets that one
        assert r.client.post("/generate", json={**GEN, "rid": f"h{i}"}).status_code == 200
    assert pair_state() == "healthy"
    assert f'baton_router_pair_state{{decode="{ds[0].url}",prefill="{ps[0].url}"}} 0.0' in r.metrics()
    view = next(p for p in r.client.get("/debug/pairs").json()["pairs"]
                if (p["prefill"], p["decode"]) == key)
    assert view["failed"] >= 2 and view["succeeded"] >= 1 and "KV transfer failed" in view["last_error"]


def test_pair_table_states_and_backoff() -> None:
    from runtime.router.pairs import PairState, PairTable
    from runtime.router.workers import Worker

    now = [0.0]
    table = PairTable(threshold=2, backoff_s=1.0, max_backoff_s=3.0, clock=lambda: now[0])
    p, d = Worker("prefill", "http://p"), Worker("decode", "http://d")
    table.failed(p, d, "x")
    assert table.usable(p, d)  # one failure: still healthy
    table.failed(p, d, "x")
    assert not table.usable(p, d) and table.states()[(p.url, d.url)] is PairState.QUARANTINED
    now[0] = 1.0
    assert table.usable(p, d)
    assert table.sent(p, d)  # the probe
    assert not table.usable(p, d) and not table.sent(p, d)  # one probe at a time
    table.released(p, d)  # its client left: no verdict, the next request probes
    assert table.usable(p, d)
    assert table.sent(p, d)
    table.failed(p, d, "x")  # the probe failed: twice as long
    assert table.view()[0]["backoff_s"] == 2.0
    now[0] = 3.0
    table.sent(p, d)
    table.failed(p, d, "x")
    assert table.view()[0]["backoff_s"] == 3.0  # capped
    now[0] = 6.0
    table.sent(p, d)
    table.succeeded(p, d, 0.1)
    assert table.usable(p, d) and table.states()[(p.url, d.url)] is PairState.HEALTHY
    assert table.forget(p) == [(p.url, d.url)] and table.view() == []


def test_retry_flags_are_checked() -> None:
    from runtime.router.args import parse_router_args

    base = ["--prefill", "http://p:1", "--decode", "http://d:2"]
    config = parse_router_args([*base, "--max-retries", "0", "--pair-quarantine-s", "0.5"])
    assert config.max_retries == 0 and config.pair_quarantine_s == 0.5
    for bad in (["--max-retries", "-1"], ["--pair-failures", "0"], ["--retry-backoff-s", "0"]):
        with pytest.raises(SystemExit):
            parse_router_args([*base, *bad])
    assert json.dumps(parse_router_args(base).max_retries) == "2"


@pytest.mark.parametrize("stream", [False, True])
def test_fallback_colocated_sends_to_a_decode_alone(workers: Any, router: Any,
                                                    stream: bool) -> None:
    p, d = workers("prefill"), workers("decode")
    d.local_prefill = True
    r = router([p], [d], "--fallback", "colocated", "--health-interval-s", "0.1")
    assert r.client.get("/ready").json().get("degraded") is None
    p.ready = False
    wait_for(lambda: "degraded" in r.client.get("/ready").json(), what="the router degraded")
    assert r.client.get("/ready").status_code == 200
    body = {**GEN, "stream": stream}
    if stream:
        status, got = sse(r.client, "/generate", body)
        assert got[-1] == "[DONE]"
    else:
        status = r.client.post("/generate", json=body).status_code
    assert status == 200
    sent = d.generation().body
    assert "bootstrap_room" not in sent and "bootstrap_host" not in sent
    assert "bootstrap_ticket" not in sent and not p.got(sent["rid"])
    assert metric(r, "baton_router_pd_fallback_total") == 1
    p.ready = True  # a prefill is back: disaggregated again
    wait_for(lambda: "degraded" not in r.client.get("/ready").json(), what="the router healed")
    assert r.client.post("/generate", json=GEN).status_code == 200
    assert "bootstrap_room" in d.generation().body
    assert metric(r, "baton_router_pd_fallback_total") == 1


def test_fallback_fail_or_without_a_local_decode_is_a_503(workers: Any, router: Any) -> None:
    p, d = workers("prefill"), workers("decode")
    failing = router([p], [d], "--health-interval-s", "0.1")
    colocated = router([p], [d], "--fallback", "colocated", "--health-interval-s", "0.1")
    p.ready = False
    for r in (failing, colocated):
        wait_for(lambda r=r: r.client.get("/ready").status_code == 503, what="router unready")
        answer = r.client.post("/generate", json=GEN)
        assert answer.status_code == 503, answer.text
        assert "no ready prefill worker" in answer.json()["error"]["message"]
    assert "--allow-local-prefill" in colocated.client.post("/generate", json=GEN).text
    assert not d.received
