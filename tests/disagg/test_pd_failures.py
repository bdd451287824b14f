"""PD failure handling with real processes (tiny random Llama, timeouts shortened by flags):
every failure ends the request with a clear error and frees its KV on both sides. On the same
pair, last: what a router in front of it measures for the P:D planner (GET /debug/planner)."""

from __future__ import annotations

import asyncio
import random
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.disagg.pd import Pair, pd_call, restart_prefill, start_pair
from tests.router.conftest import RouterThread
from tests.router.router_process import start_router

FAST = ("--bootstrap-timeout-s", "3", "--waiting-timeout-s", "6", "--heartbeat-interval-s", "0.5",
        "--heartbeat-misses", "2")


@pytest.fixture
def pair(tiny_path: Path, tmp_path: Path) -> Iterator[Pair]:
    """A pair of its own, for a test that kills one of them."""
    p = start_pair(tmp_path, "tcp", *FAST, model=str(tiny_path))
    yield p
    p.stop()


@pytest.fixture(scope="module")
def shared(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """One pair for the tests that leave it serving with empty pools (each checks that)."""
    p = start_pair(tmp_path_factory.mktemp("shared"), "tcp", *FAST, model=str(tiny_path))
    yield p
    p.stop()


def metric(url: str, name: str) -> float:
    """One sample of a worker's /metrics (0 when it is not there yet)."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def gen_body(pair: Pair, room: int | None = None, max_new: int = 8, **kw: Any) -> dict[str, Any]:
    return {"text": "Hello there, how are", "sampling_params": {"temperature": 0,
            "max_new_tokens": max_new, "ignore_eos": True}, **pair.fields(room, prompt={"text": "Hello there, how are"}), **kw}


def _text(url: str) -> str:
    """GET url's body ("" while nothing listens there yet)."""
    try:
        return httpx.get(url).text
    except httpx.ConnectError:
        return ""


def kv_free(url: str) -> bool:
    return bool(httpx.get(f"{url}/debug/stats").json()["kv_all_free"])


async def rooms_in(url: str, state: str, n: int, timeout: float = 10.0) -> None:
    """Until the server reports `n` rooms in `state` (its rooms gauge): poll, never sleep."""
    deadline = time.monotonic() + timeout
    while metric(url, f'baton_disagg_rooms{{state="{state}"}}') != n:
        assert time.monotonic() < deadline, f"{url} never had {n} rooms {state}"
        await asyncio.sleep(0.02)


def eventually(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def test_works_then_missing_or_duplicate_bootstrap_fields_are_4xx(shared: Pair) -> None:
    pair = shared
    transfers = [metric(srv.url, "baton_kv_transfers_total") for srv in (pair.prefill, pair.decode)]
    prefill, decoded = asyncio.run(_one(pair, gen_body(pair)))
    assert prefill.status_code == 200 and len(decoded["output_ids"]) == 8
    for srv in (pair.prefill, pair.decode):
        r = httpx.post(f"{srv.url}/generate", json={"text": "hi"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_room", r.text
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "x", "prompt": "hi"})
        assert r.status_code in (400, 404)
    body = gen_body(pair)

    async def dup() -> tuple[httpx.Response, httpx.Response, Any]:
        async with httpx.AsyncClient(timeout=30) as http:
            # a decode request waits in its room; a second one with the same room is refused
            waiting = asyncio.ensure_future(http.post(f"{pair.decode.url}/generate", json=body))
            await rooms_in(pair.decode.url, "waiting_for_input", 1)
            again = await http.post(f"{pair.decode.url}/generate", json={
                **body, **pair.fields(body["bootstrap_room"], rid="other", prompt=body)})
            p_first = await http.post(f"{pair.prefill.url}/generate", json=body)
            return again, p_first, await waiting
    again, p_first, done = asyncio.run(dup())
    assert again.status_code == 409 and again.json()["error"]["code"] == "room_in_use", again.text
    assert p_first.status_code == 200 and done.status_code == 200
    prefill, decoded = asyncio.run(_one(pair, gen_body(pair)))
    assert prefill.status_code == 200 and len(decoded["output_ids"]) == 8  # still serving
    eventually(lambda: kv_free(pair.prefill.url) and kv_free(pair.decode.url))
    # the prefill side refuses a second request for a room it already has
    async def twice() -> list[httpx.Response]:
        body = gen_body(pair)
        async with httpx.AsyncClient(timeout=30) as http:
            first = asyncio.ensure_future(http.post(f"{pair.prefill.url}/generate", json=body))
            await rooms_in(pair.prefill.url, "bootstrapping", 1)
            again = await http.post(f"{pair.prefill.url}/generate", json={
                **body, **pair.fields(body["bootstrap_room"], rid="x2", prompt=body)})
            done = await http.post(f"{pair.decode.url}/generate", json=body)
            return [again, await first, done]
    again, first, done = asyncio.run(twice())
    assert again.status_code == 409 and first.status_code == 200 and done.status_code == 200
    for srv, before in zip((pair.prefill, pair.decode), transfers, strict=True):
        assert metric(srv.url, "baton_kv_transfers_total") == before + 4


async def _one(pair: Pair, body: dict[str, Any]) -> tuple[httpx.Response, Any]:
    async with httpx.AsyncClient(timeout=60) as http:
        return await pd_call(http, pair, "/generate", body)


def test_decode_that_never_shows_up_frees_the_room(shared: Pair) -> None:
    pair, timeouts = shared, 'baton_kv_transfer_failures_total{reason="bootstrap_timeout"}'
    before = metric(shared.prefill.url, timeouts)
    began = time.monotonic()
    r = httpx.post(f"{pair.prefill.url}/generate", json=gen_body(pair), timeout=30)
    assert r.status_code == 502, r.text
    assert "no decode server asked for room" in r.json()["error"]["message"]
    assert 2.5 < time.monotonic() - began < 10
    assert kv_free(pair.prefill.url)
    assert metric(pair.prefill.url, timeouts) == before + 1


def test_prefill_killed_while_rooms_wait_then_a_restarted_prefill_is_found(
    pair: Pair, tiny_path: Path, tmp_path: Path
) -> None:
    async def waiting_then_kill() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as http:
            calls = [asyncio.ensure_future(http.post(f"{pair.decode.url}/generate", json=gen_body(pair)))
                     for _ in range(4)]
            await rooms_in(pair.decode.url, "waiting_for_input", 4)  # registered, waiting for KV
            assert not kv_free(pair.decode.url)
            pair.prefill.kill()
            return list(await asyncio.gather(*calls))

    began = time.monotonic()
    results = asyncio.run(waiting_then_kill())
    for r in results:
        assert r.status_code == 502, r.text
        assert "stopped answering" in r.json()["error"]["message"]
    assert time.monotonic() - began < 6, "heartbeats should notice within ~1 s"
    eventually(lambda: kv_free(pair.decode.url))
    restart_prefill(pair, tmp_path, "tcp", *FAST, model=str(tiny_path))
    prefill, decoded = asyncio.run(_one(pair, gen_body(pair)))
    assert prefill.status_code == 200, prefill.text
    assert len(decoded["output_ids"]) == 8


class SlowLoris:
    """`n` connections to a KV port that each start a handshake and then send one byte every
    `every_s`, connecting again whenever the receiver closes one: they hold what unproven
    links may hold for as long as the test runs."""

    def __init__(self, port: int, n: int, every_s: float = 4.0) -> None:
        self.port, self.every_s, self.stop = port, every_s, threading.Event()
        self.threads = [threading.Thread(target=self._one, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _one(self) -> None:
        while not self.stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
                    sock.sendall(bytes([60]))  # a 60-byte prefill id follows, one byte at a time
                    while not self.stop.wait(self.every_s):
                        sock.sendall(b"p")
            except OSError:  # closed on us: again
                self.stop.wait(0.05)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)


def test_slow_loris_kv_links_do_not_lock_out_a_restarted_prefill(
        pair: Pair, tiny_path: Path, tmp_path: Path) -> None:
    """128 slow connections to the decode's KV port (twice what may wait for a proof): a
    restarted prefill, which must open a new link, still gets its requests through."""
    prefill, decoded = asyncio.run(_one(pair, gen_body(pair)))
    assert prefill.status_code == 200, prefill.text
    port = int(re.search(r"KV receiver on [\d.]+:(\d+)", pair.decode.log()).group(1))  # type: ignore[union-attr]
    loris = SlowLoris(port, 128)
    try:
        time.sleep(1.0)  # every slot taken
        pair.prefill.kill()
        restart_prefill(pair, tmp_path, "tcp", *FAST, model=str(tiny_path))
        for _ in range(4):
            prefill, decoded = asyncio.run(_one(pair, gen_body(pair)))
            assert prefill.status_code == 200, prefill.text
            assert len(decoded["output_ids"]) == 8
    finally:
        loris.close()
    eventually(lambda: kv_free(pair.decode.url) and kv_free(pair.prefill.url))


def test_decode_killed_prefill_frees_its_pages(pair: Pair) -> None:
    body = gen_body(pair)

    async def register_then_kill() -> httpx.Response:
        async with httpx.AsyncClient(timeout=30) as http:
            orphan = asyncio.ensure_future(http.post(f"{pair.decode.url}/generate", json=body))
            await rooms_in(pair.decode.url, "waiting_for_input", 1)  # registered at the prefill
            pair.decode.kill()
            with pytest.raises(httpx.RemoteProtocolError):
                await orphan
            return await http.post(f"{pair.prefill.url}/generate", json=body)

    r = asyncio.run(register_then_kill())
    assert r.status_code == 502, r.text
    assert "KV transfer to the decode server failed" in r.json()["error"]["message"]
    eventually(lambda: kv_free(pair.prefill.url))


def test_client_abort_on_decode_cancels_the_room_everywhere(shared: Pair) -> None:
    pair = shared
    body = gen_body(pair)

    async def abort_waiting() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as http:
            waiting = asyncio.ensure_future(http.post(f"{pair.decode.url}/generate", json=body))
            await rooms_in(pair.decode.url, "waiting_for_input", 1)
            ack = await http.post(f"{pair.decode.url}/abort", json={"rid": body["rid"]})
            assert ack.json()["aborted"] is True
            late = await http.post(f"{pair.prefill.url}/generate", json=body)
            return await waiting, late

    aborted, late = asyncio.run(abort_waiting())
    assert aborted.status_code == 502 and "/abort" in aborted.json()["error"]["message"]
    assert late.status_code == 502 and "cancelled" in late.json()["error"]["message"]
    eventually(lambda: kv_free(pair.prefill.url) and kv_free(pair.decode.url))


def test_mismatched_kv_layout_is_a_clear_error(tiny_path: Path, tmp_path: Path) -> None:
    """A router in front never pairs the two, and says why in its /ready and log from the
    start; a request sent to the pair directly fails at first contact, freeing both sides.
    Their revisions differ too (runtime/revision.py): each error names both."""
    pair = start_pair(tmp_path, "tcp", *FAST, model=str(tiny_path),
                      prefill_extra=("--revision", "r-old"),
                      decode_extra=("--page-size", "8", "--revision", "r-new"))
    router = start_router("--prefill", f"{pair.prefill.url},{pair.bootstrap_port}",
                          "--decode", pair.decode.url, log_path=tmp_path / "router.log", ready=False,
                          env=pair.env)
    try:
        why = f"prefill {pair.prefill.url} vs decode {pair.decode.url}: KV page_size 16 vs 8"
        eventually(lambda: why in _text(f"{router.url}/ready"))
        assert httpx.get(f"{router.url}/ready").status_code == 503
        answer = httpx.post(f"{router.url}/generate", json={"text": "hi"})
        assert answer.status_code == 503 and why in answer.json()["error"]["message"]
        assert why in router.log() and "revision r-old vs r-new" in router.log()
        for srv, rev in ((pair.prefill, "r-old"), (pair.decode, "r-new")):
            assert httpx.get(f"{srv.url}/server_info").json()["revision"] == rev

        prefill, decoded = asyncio.run(_one(pair, gen_body(pair)))
        assert decoded.status_code == 502
        message = decoded.json()["error"]["message"]
        assert "cannot send KV here" in message and "page_size 16 vs 8" in message, message
        assert "revision r-old vs r-new" in message, message
        assert prefill.status_code == 502  # its room never got a decode server
        eventually(lambda: kv_free(pair.prefill.url) and kv_free(pair.decode.url))
    finally:
        assert router.stop() == 0
        pair.stop()


def test_decode_killed_mid_stream_through_the_router(pair: Pair, tmp_path: Path) -> None:
    """The client gets an in-band error and [DONE], never a hang; the prefill keeps no KV."""
    router = start_router("--prefill", f"{pair.prefill.url},{pair.bootstrap_port}",
                          "--decode", pair.decode.url, log_path=tmp_path / "router.log",
                          env=pair.env)
    try:
        body = {"text": "Tell me a long story", "stream": True,
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}}
        began, events = time.monotonic(), []
        with httpx.Client(timeout=60) as http, \
                http.stream("POST", f"{router.url}/generate", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line)
                if len(events) == 3:
                    pair.decode.kill()
        assert events[-1] == "data: [DONE]", events[-3:]
        assert '"error"' in events[-2], events[-3:]
        assert time.monotonic() - began < 30
        eventually(lambda: kv_free(pair.prefill.url))
    finally:
        router.stop()


def test_random_client_disconnects_through_the_router_leave_no_kv(shared: Pair, tmp_path: Path) -> None:
    """40 streamed requests, half of them dropped by the client after a random number of chunks
    (some before the first token, while their room is still being set up): afterwards both
    pools are empty and the pair still serves."""
    pair = shared
    router = start_router("--prefill", f"{pair.prefill.url},{pair.bootstrap_port}",
                          "--decode", pair.decode.url, log_path=tmp_path / "router.log",
                          env=pair.env)
    rng = random.Random(3)

    async def one(http: httpx.AsyncClient, drop_after: int | None) -> None:
        body = {"text": "Count with me: one, two,", "stream": True,
                "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
        async with http.stream("POST", f"{router.url}/generate", json=body) as resp:
            seen = 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data: ")
                if drop_after is not None and seen >= drop_after:
                    return  # leaving the block closes the connection mid-stream

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            plan = [rng.choice([None, 0, 1, 2, 5]) for _ in range(40)]
            await asyncio.gather(*(one(http, d) for d in plan))

    try:
        asyncio.run(run())
        eventually(lambda: kv_free(pair.prefill.url) and kv_free(pair.decode.url), timeout=20)
        prefill, decoded = asyncio.run(_one(pair, gen_body(pair)))
        assert prefill.status_code == 200 and len(decoded["output_ids"]) == 8
    finally:
        router.stop()


def test_a_request_waiting_for_its_kv_is_queued_not_running(shared: Pair) -> None:
    """The decode's counts come from what its scheduler and rooms hold: a request in its room,
    waiting for the prefill's KV, is queue depth, not a running request."""
    pair, body = shared, gen_body(shared)

    async def wait_then_feed() -> tuple[float, float, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as http:
            waiting = asyncio.ensure_future(http.post(f"{pair.decode.url}/generate", json=body))
            deadline = time.monotonic() + 10
            while metric(pair.decode.url, "baton_queue_depth") != 1:
                assert time.monotonic() < deadline, "the decode never counted it as queued"
                await asyncio.sleep(0.05)
            running = metric(pair.decode.url, "baton_running_requests")
            queued = metric(pair.decode.url, "baton_queue_depth")
            fed = await http.post(f"{pair.prefill.url}/generate", json=body)
            return queued, running, fed, await waiting

    queued, running, fed, done = asyncio.run(wait_then_feed())
    assert (queued, running) == (1, 0)
    assert fed.status_code == 200 and done.status_code == 200
    eventually(lambda: metric(pair.decode.url, "baton_queue_depth") == 0
               and metric(pair.decode.url, "baton_running_requests") == 0)


def test_the_router_measures_the_planner_figures(shared: Pair,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests through a router: its /debug/planner shows their prompts (the prefill's figures,
    as /ready shows them), their outputs (the decode's), both pools' speeds and the decode's
    KV pool, in the JSON the operator's planner reads; the workers' /metrics count the same."""
    pair, rng = shared, random.Random(39)
    for name, value in pair.env.items():
        monkeypatch.setenv(name, value)
    router = RouterThread(["--prefill", f"{pair.prefill.url},{pair.bootstrap_port}",
                           "--decode", pair.decode.url]).wait_ready()
    # its first polls came before the traffic: what the pair did before is not counted
    lengths, max_new = [20, 30, 40, 50], 8

    async def one(http: httpx.AsyncClient, n: int) -> int:
        r = await http.post(f"{router.url}/generate", json={
            "input_ids": [rng.randrange(100, 40_000) for _ in range(n)],
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == max_new, r.text
        return n - int(r.json()["meta_info"]["cached_tokens"])

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as http:
            return list(await asyncio.gather(*(one(http, n) for n in lengths)))

    def view() -> dict[str, Any]:
        return dict(router.client.get("/debug/planner").json())

    try:
        computed = asyncio.run(run())
        eventually(lambda: (view()["output_tokens"] or {}).get("count") == 4)
        got = view()
    finally:
        router.stop()
    assert got["missing"] == [] and got["ready"] == {"prefill": 1, "decode": 1}, got
    assert got["rate"] > 0 and got["window_s"] > 0
    assert got["prompt_tokens"] == {"mean": sum(computed) / 4, "count": 4,
                                    "second": sum(n * n for n in computed) / 4}
    assert got["output_tokens"] == {"mean": max_new, "second": max_new ** 2, "count": 4}
    assert got["prefill_tokens_per_s"] > 0
    assert got["decode_steps"] and all(b >= 1 and t > 0 for b, t in got["decode_steps"])
    info = httpx.get(f"{pair.decode.url}/server_info").json()
    assert got["decode_kv_tokens"] == info["kv_capacity_tokens"]
    planner = pytest.importorskip("baton_operator.planner")
    planner.figures_from({**got, "ttft_target_s": 1, "itl_target_s": 0.1})
    assert metric(pair.prefill.url, "baton_planner_prompts_total") >= 4
    assert metric(pair.prefill.url, 'baton_forward_seconds_total{mode="extend"}') > 0
    assert metric(pair.decode.url, "baton_planner_output_tokens_total") >= 4 * max_new
    assert metric(pair.decode.url, 'baton_forwards_total{mode="decode"}') >= max_new - 1
