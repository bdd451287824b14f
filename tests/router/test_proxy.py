"""The PD wire contract through a real router over real HTTP (docs/disaggregation.md "Wire contract")."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from tests.router.conftest import RouterThread, wait_for
from tests.router.fake_worker import FakeWorker

PD = tuple[RouterThread, FakeWorker, FakeWorker]
BODIES = {
    "/generate": {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4}},
    "/v1/completions": {"model": "m", "prompt": "The capital of France is", "max_tokens": 4},
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
}


def events(lines: list[str]) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded ("[DONE]" kept as is)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def sse(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    with client.stream("POST", path, json=body) as r:
        return r.status_code, events(list(r.iter_lines()))


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("stream", [False, True])
def test_both_sides_get_the_body_rid_and_one_room(pd: PD, path: str, stream: bool) -> None:
    router, p, d = pd
    body = {**BODIES[path], "stream": stream}
    if stream:  # only allowed with a stream (a 400 otherwise, as a worker answers)
        body["stream_options"] = {"include_usage": True}
    if stream:
        status, got = sse(router.client, path, body)
        assert got[-1] == "[DONE]" and len(got) == 4
    else:
        r = router.client.post(path, json=body)
        status = r.status_code
        assert r.json()["object" if path != "/generate" else "meta_info"]
    assert status == 200
    sent_d = d.generation().body
    sent_p = p.generation(sent_d["rid"]).body  # (P may get its copy after D answered)
    for key in ("rid", "bootstrap_host", "bootstrap_port", "bootstrap_room"):
        assert sent_p[key] == sent_d[key], key
    room, rid = sent_d["bootstrap_room"], sent_d["rid"]
    assert isinstance(room, int) and 0 <= room < 2**63
    assert isinstance(rid, str) and len(rid) == 32  # uuid4().hex
    assert (sent_p["bootstrap_host"], sent_p["bootstrap_port"]) == ("127.0.0.1", 8998)
    # D: the client's body as sent (a one-choice stream, which the router follows to move
    # it if D fails: one a draining decode may move with its KV, and an OpenAI one with
    # token ids); P: the same, but never streaming
    follow: dict[str, bool] = {"allow_kv_move": True} if stream else {}
    if stream and path != "/generate":
        follow["return_token_ids"] = True
    assert {k: v for k, v in sent_d.items() if not k.startswith(("bootstrap_", "rid"))} == {
        **body, **follow}
    assert sent_p["stream"] is False and "stream_options" not in sent_p
    assert {k: v for k, v in sent_p.items() if k not in ("stream",)} == {
        k: v for k, v in sent_d.items() if k not in ("stream", "stream_options")}


def test_distinct_rooms_per_choice(pd: PD) -> None:
    router, p, d = pd
    cases = [
        ("/v1/chat/completions", {**BODIES["/v1/chat/completions"], "n": 3}, 3),
        ("/v1/completions", {"model": "m", "prompt": ["a", "b"]}, 2),
        ("/v1/completions", {"model": "m", "prompt": [[1, 2], [3], [4]], "n": 2}, 6),
        ("/v1/completions", {"model": "m", "prompt": [1, 2, 3], "n": 1}, 1),
    ]
    for path, body, choices in cases:
        assert router.client.post(path, json=body).status_code == 200
        sent = d.generation().body
        rooms = sent["bootstrap_room"]  # (P may get its copy after D answered: wait for it)
        assert p.generation(sent["rid"]).body["bootstrap_room"] == rooms
        if choices == 1:
            assert isinstance(rooms, int)
        else:
            assert isinstance(rooms, list) and len(set(rooms)) == choices, (body, rooms)
            assert all(isinstance(r, int) and 0 <= r < 2**63 for r in rooms)


def test_client_room_and_generate_rid_are_kept(pd: PD) -> None:
    router, p, d = pd
    body = {**BODIES["/generate"], "rid": "my-rid", "bootstrap_room": 12345}
    assert router.client.post("/generate", json=body).status_code == 200
    for w in (p, d):
        assert w.generation().body["rid"] == "my-rid"
        assert w.generation().body["bootstrap_room"] == 12345
    rooms = [7, 8, 9]
    chat = {**BODIES["/v1/chat/completions"], "n": 3, "bootstrap_room": rooms, "rid": "theirs"}
    assert router.client.post("/v1/chat/completions", json=chat).status_code == 200
    assert d.generation().body["bootstrap_room"] == rooms
    assert d.generation().body["rid"] != "theirs"  # OpenAI endpoints: the router's rid


@pytest.mark.parametrize("stream", [False, True])
def test_what_only_the_router_may_set_is_not_taken_from_a_client(pd: PD, stream: bool) -> None:
    """A client's `resume` (tokens it claims to have), `return_token_ids`, `allow_kv_move`, ticket
    and bootstrap address never reach a worker as the client sent them."""
    router, p, d = pd
    forged = {"resume": {"output_ids": [1, 2, 3], "text_chars": 3}, "return_token_ids": True,
              "allow_kv_move": True, "bootstrap_ticket": "v1.forged.mac",
              "bootstrap_host": "10.9.9.9", "bootstrap_port": 1}
    for path, body in BODIES.items():
        r = router.client.post(path, json={**body, **forged, "stream": stream})
        assert r.status_code == 200, r.text
        sent_d = d.generation().body
        for sent in (sent_d, p.generation(sent_d["rid"]).body):
            assert "resume" not in sent and "bootstrap_ticket" not in sent, sent
            assert (sent["bootstrap_host"], sent["bootstrap_port"]) == ("127.0.0.1", 8998)
            following = stream  # the router's own follower asks for these (both sides)
            assert sent.get("allow_kv_move", False) is following, sent
            assert sent.get("return_token_ids", False) is (following and path != "/generate"), sent


def test_sse_reaches_the_client_before_the_worker_sends_more(pd: PD) -> None:
    router, _, d = pd
    body = {**BODIES["/v1/completions"], "stream": True,
            "fake": {"decode": {"chunks": 3, "gated": True}}}
    with router.client.stream("POST", "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        for i in range(3):
            line = next(line for line in lines if line)
            assert json.loads(line.removeprefix("data: "))["choices"][0]["text"] == f"tok{i} "
            # D has sent exactly this event so far: it waits for the gate before the next one
            assert len(d.sent_at) == i + 1
            d.release()
        assert [line for line in lines if line] == ["data: [DONE]"]


def test_prefill_error_aborts_decode_and_is_returned(pd: PD) -> None:
    router, p, d = pd
    for stream in (False, True):
        body = {**BODIES["/generate"], "stream": stream, "fake": {
            "prefill": {"status": 400, "message": "prompt too long"},
            "decode": {"hang": True}}}
        r = router.client.post("/generate", json=body)
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "prompt too long"
        rid = d.generation().body["rid"]
        wait_for(lambda rid=rid: rid in d.aborts, what="decode aborted")  # type: ignore[misc]
        assert rid not in p.aborts


def test_decode_error_aborts_prefill_and_is_returned(pd: PD) -> None:
    router, p, d = pd
    body = {**BODIES["/v1/chat/completions"], "stream": True, "fake": {
        "prefill": {"hang": True}, "decode": {"status": 409, "message": "room in use"}}}
    r = router.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 409 and r.json()["error"]["message"] == "room in use"
    rid = p.generation().body["rid"]
    wait_for(lambda: rid in p.aborts, what="prefill aborted")
    assert rid not in d.aborts


def test_prefill_failing_after_decode_answered_does_not_end_the_stream(pd: PD) -> None:
    """Once D streams, it holds the KV: P's reply (stuck, or failing) no longer matters."""
    router, p, d = pd
    body = {**BODIES["/generate"], "stream": True, "fake": {
        "prefill": {"delay_s": 0.3, "status": 500, "message": "reply lost"},
        "decode": {"chunks": 5, "gated": True}}}
    with router.client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
        wait_for(lambda: 'reason="status",side="prefill"' in router.metrics(),
                 what="P's failure counted")
        d.release(4)
        got = events([line for line in lines if line])
    assert [e["text"] for e in got[:-1]] == [f"tok{i} " for i in range(1, 5)]
    assert got[-1] == "[DONE]"
    rid = d.generation().body["rid"]
    assert rid not in d.aborts and rid not in p.aborts
    assert 'endpoint="/generate",status="200"} 1.0' in router.metrics()


def test_decode_dying_mid_stream_ends_in_band_without_hanging(workers: Any, router: Any) -> None:
    """Without migrations (else see test_retry.py), a broken stream ends in-band."""
    p, d = workers("prefill"), workers("decode")
    router = router([p], [d], "--max-migrations", "0")
    body = {**BODIES["/v1/completions"], "stream": True,
            "fake": {"decode": {"chunks": 5, "die_after": 2}}}
    started = time.monotonic()
    status, got = sse(router.client, "/v1/completions", body)
    assert status == 200 and time.monotonic() - started < 5
    assert [e["choices"][0]["text"] for e in got[:2]] == ["tok0 ", "tok1 "]
    assert got[2]["error"]["code"] == "decode_broken"
    assert d.url in got[2]["error"]["message"]
    assert got[3:] == ["[DONE]"]
    wait_for(lambda: p.generation().body["rid"] in p.aborts, what="prefill aborted")
    assert 'reason="broken",side="decode"' in router.metrics()


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts_both(pd: PD, stream: bool) -> None:
    router, p, d = pd
    steer = {"chunks": 5, "gated": True} if stream else {"hang": True}
    body = {**BODIES["/v1/chat/completions"], "stream": stream,
            "fake": {"prefill": {"hang": True}, "decode": steer}}
    with httpx.Client(base_url=router.url, timeout=httpx.Timeout(10, read=0.5),
                      trust_env=False) as client:
        if stream:
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert next(line for line in r.iter_lines() if line).startswith("data: {")
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post("/v1/chat/completions", json=body)
    rid = d.generation().body["rid"]
    wait_for(lambda: rid in d.aborts and rid in p.aborts, what="both sides aborted")
    wait_for(lambda: 'status="499"' in router.metrics(), what="499 counted")


def test_a_silent_worker_times_out(workers: Any, router: Any) -> None:
    p, d = workers("prefill"), workers("decode")
    r = router([p], [d], "--request-timeout-s", "0.5")
    body = {**BODIES["/generate"], "fake": {"decode": {"hang": True}}}
    started = time.monotonic()
    answer = r.client.post("/generate", json=body)
    assert answer.status_code == 504 and time.monotonic() - started < 5
    assert answer.json()["error"]["code"] == "decode_timeout"
    rid = p.generation().body["rid"]
    wait_for(lambda: rid in p.aborts, what="prefill aborted")


def test_unreachable_prefill_is_a_502_and_leaves_the_ready_set(workers: Any,
                                                               router: Any) -> None:
    p, d = workers("prefill"), workers("decode")
    router = router([p], [d], "--retry-wait-s", "0.3")  # for a prefill to come back
    p.stop()
    r = router.client.post("/generate", json={**BODIES["/generate"],
                                              "fake": {"decode": {"hang": True}}})
    assert r.status_code in (502, 503)  # 503 if a health check saw it go first
    if r.status_code == 502:
        assert r.json()["error"]["code"] == "prefill_connect"
        wait_for(lambda: d.generation().body["rid"] in d.aborts, what="decode aborted")
    assert router.client.get("/ready").status_code == 503


async def test_concurrent_requests_each_get_their_own_answer(workers: Any, router: Any) -> None:
    ps = [workers("prefill") for _ in range(2)]
    ds = [workers("decode") for _ in range(2)]
    r = router(ps, ds, "--policy", "least_load")

    async def one(client: httpx.AsyncClient, i: int) -> None:
        stream, fails = i % 2 == 0, i % 7 == 0
        body: dict[str, Any] = {"text": f"prompt {i}", "rid": f"req{i}", "stream": stream,
                                "fake": {"decode": {"chunks": 4, "delay_s": 0.01 * (i % 5)}}}
        if fails:
            body["fake"]["prefill"] = {"status": 400, "message": f"bad {i}"}
            body["fake"]["decode"]["hang"] = True
        answer = await client.post("/generate", json=body)
        if fails:
            assert answer.status_code == 400 and answer.json()["error"]["message"] == f"bad {i}"
        elif stream:
            got = events(answer.text.splitlines())
            assert [e["meta_info"]["id"] for e in got[:-1]] == [f"req{i}"] * 4
            assert got[-1] == "[DONE]"
        else:
            assert answer.json()["meta_info"]["id"] == f"req{i}"

    async with httpx.AsyncClient(base_url=r.url, timeout=20, trust_env=False) as client:
        await asyncio.gather(*(one(client, i) for i in range(48)))
    wait_for(lambda: all(f'worker="{w.url}"}} 0.0' in r.metrics() for w in ps + ds),
             what="every worker's in-flight back to 0")
    m = r.metrics()
    assert 'endpoint="/generate",status="200"} 41.0' in m
    assert 'endpoint="/generate",status="400"} 7.0' in m
