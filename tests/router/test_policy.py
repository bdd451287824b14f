"""Which (prefill, decode) pair each policy picks, seen from the workers' side."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from runtime.kvcache.radix import block_hashes
from runtime.router.kv_index import KVIndex
from runtime.router.policy import CacheAware
from runtime.router.workers import Worker
from tests.router.conftest import wait_for
from tests.router.fake_worker import FakeWorker


def served_by(workers: list[FakeWorker], rid: str) -> int:
    """Index of the worker that got request `rid` (P's copy may land after D answered)."""
    wait_for(lambda: any(w.got(rid) for w in workers), 2.0, f"a worker to get {rid}")
    hits = [i for i, w in enumerate(workers) if w.got(rid)]
    assert len(hits) == 1, (rid, hits)
    return hits[0]


def idle(router: Any, worker: FakeWorker) -> None:
    """Wait until the router has no request in flight on `worker`."""
    wait_for(lambda: f'worker="{worker.url}"}} 0.0' in router.metrics(), what="in-flight 0")


def send(router: Any, rid: str, text: str = "hello", **steer: Any) -> httpx.Response:
    return router.client.post("/generate", json={"text": text, "rid": rid, "fake": steer})


def test_round_robin_has_a_cursor_per_role(workers: Any, router: Any) -> None:
    ps = [workers("prefill") for _ in range(2)]
    ds = [workers("decode") for _ in range(3)]
    r = router(ps, ds)  # round_robin is the default
    for i in range(6):
        assert send(r, f"r{i}").status_code == 200
    assert [served_by(ps, f"r{i}") for i in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [served_by(ds, f"r{i}") for i in range(6)] == [0, 1, 2, 0, 1, 2]


def test_least_load_prefers_the_idle_worker(workers: Any, router: Any) -> None:
    ps = [workers("prefill") for _ in range(2)]
    ds = [workers("decode") for _ in range(2)]
    r = router(ps, ds, "--policy", "least_load")
    busy = {"text": "hello", "rid": "busy",
            "fake": {"prefill": {"hang": True}, "decode": {"hang": True}}}
    # its own connection: an httpx.Client is not to be shared between threads
    hanging = threading.Thread(target=httpx.post, args=(f"{r.url}/generate",),
                               kwargs={"json": busy, "timeout": 30, "trust_env": False})
    hanging.start()
    wait_for(lambda: any(w.received for w in ds), what="the first request in flight")
    busy_p, busy_d = served_by(ps, "busy"), served_by(ds, "busy")
    for i in range(3):  # while it runs, every request goes to the other pair
        assert send(r, f"r{i}").status_code == 200
        assert (served_by(ps, f"r{i}"), served_by(ds, f"r{i}")) == (1 - busy_p, 1 - busy_d)
        idle(r, ps[1 - busy_p])  # a stand-in D may answer before P did
    for w in (ps[busy_p], ds[busy_d]):
        w.aborts.append("busy")  # let it finish
    hanging.join(10)
    idle(r, ps[busy_p])
    # idle again: ties go to the worker picked least often
    assert send(r, "after").status_code == 200
    assert served_by(ps, "after") == busy_p


def blocks_of(ids: list[int], url: str, index: KVIndex, page: int = 4) -> None:
    """Tell `index` that the worker at `url` caches the full pages of `ids`."""
    hashes = block_hashes(ids, page)
    index.apply(url, {"type": "snapshot", "seq": 0, "instance": "i", "page_size": page,
                      "blocks": []})
    index.apply(url, {"type": "stored", "seq": len(hashes), "blocks": hashes})


def test_the_index_follows_events_and_refuses_a_gap() -> None:
    index = KVIndex()
    ids = list(range(100, 118))  # 4 full pages of 4 and 2 tokens
    blocks_of(ids, "p0", index)
    assert index.cached_tokens("p0", ids) == 16 and index.cached_tokens("p1", ids) == 0
    assert index.cached_tokens("p0", [*ids[:8], 7, 7, 7, 7]) == 8  # the third page differs
    index.apply("p0", {"type": "removed", "seq": 5, "blocks": block_hashes(ids, 4)[2:3]})
    assert index.cached_tokens("p0", ids) == 8  # a hole ends the match
    with pytest.raises(ValueError, match="skipped"):
        index.apply("p0", {"type": "stored", "seq": 9, "blocks": [1]})
    with pytest.raises(ValueError, match="before its snapshot"):
        index.apply("p9", {"type": "stored", "seq": 1, "blocks": [1]})
    index.drop("p0")
    assert index.cached_tokens("p0", ids) == 0 and index.view() == {}


def test_a_routed_prompt_counts_as_cached_there_until_its_events_come() -> None:
    index = KVIndex(pending_s=0.3)
    blocks_of([], "p0", index)
    ids = list(range(40))
    index.expect("p0", ids)
    assert index.cached_tokens("p0", ids) == 40
    time.sleep(0.4)
    assert index.cached_tokens("p0", ids) == 0  # nothing came: it was a guess


def test_cache_aware_picks_the_least_to_compute_and_weighs_the_load() -> None:
    index = KVIndex()
    policy = CacheAware(index, load_tokens=256)
    ps = [Worker("prefill", "http://p0:1", 8998, ready=True),
          Worker("prefill", "http://p1:1", 8998, ready=True)]
    d = [Worker("decode", "http://d0:1", ready=True)]
    system = list(range(1000, 1400))  # 100 pages of 4
    blocks_of(system, "http://p1:1", index)
    blocks_of([], "http://p0:1", index)
    assert policy.pick(ps, d, [*system, 1, 2, 3])[0] is ps[1]  # 3 tokens to compute, not 403
    ps[1].in_flight = 1  # 3 + 256 < 403: still worth waiting for
    assert policy.pick(ps, d, [*system, 4, 5])[0] is ps[1]
    ps[1].in_flight = 2  # 2 + 512 > 402: the idle one computes it sooner
    assert policy.pick(ps, d, [*system, 6, 7])[0] is ps[0]
    assert policy.pick(ps, d, None)[0] is ps[0]  # no ids: least_load


def test_a_follower_retries_a_loading_worker_soon_and_one_without_a_cache_rarely() -> None:
    """A prefill still loading (503 not_ready) is asked again within a second, so a router
    started with its workers learns their caches at once; one that keeps no cache
    (503 no_kv_events) is asked again only after NO_CACHE_RETRY_S."""
    import asyncio
    import json as json_

    from runtime.router.kv_index import NO_CACHE_RETRY_S, follow

    def worker(codes: list[str]) -> tuple[httpx.MockTransport, list[str]]:
        calls: list[str] = []

        def answer(request: httpx.Request) -> httpx.Response:
            calls.append(request.url.path)
            if len(calls) <= len(codes):
                return httpx.Response(503, json={"error": {"code": codes[len(calls) - 1]}})
            snapshot = {"type": "snapshot", "seq": 3, "instance": "i", "page_size": 4,
                        "blocks": [7]}

            async def events() -> Any:  # the snapshot, then a stream that stays open
                yield f"data: {json_.dumps(snapshot)}\n\n".encode()
                await asyncio.sleep(30)

            return httpx.Response(200, content=events(),
                                  headers={"content-type": "text/event-stream"})
        return httpx.MockTransport(answer), calls

    async def scenario(codes: list[str], within: float) -> tuple[KVIndex, list[str]]:
        transport, calls = worker(codes)
        index = KVIndex()
        async with httpx.AsyncClient(transport=transport) as client:
            task = asyncio.create_task(follow(client, index, "http://p0"))
            deadline = asyncio.get_running_loop().time() + within
            while "http://p0" not in index.workers and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
            seen = dict(index.workers)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        index.workers = seen
        return index, calls

    index, calls = asyncio.run(scenario(["not_ready", "not_ready"], within=3.0))
    assert index.workers["http://p0"].blocks == {7} and len(calls) == 3
    index, calls = asyncio.run(scenario(["no_kv_events"], within=1.0))
    assert index.workers == {} and calls == ["/kv_events"] and NO_CACHE_RETRY_S >= 10
