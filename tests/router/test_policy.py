"""Which (prefill, decode) pair each policy picks, seen from the workers' side."""

from __future__ import annotations

import threading
from typing import Any

import httpx

from runtime.router.policy import IMBALANCE_SLACK, PrefixAffinity
from runtime.router.prefix import PrefixIndex, block_hashes
from runtime.router.workers import Worker
from tests.router.conftest import wait_for
from tests.router.fake_worker import FakeWorker

SYSTEM = "You are a careful assistant. Answer in one short sentence, and cite no sources. "


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


def test_prefix_affinity_sticks_and_falls_back_to_least_load(workers: Any, router: Any) -> None:
    ps = [workers("prefill") for _ in range(2)]
    d = workers("decode")
    r = router(ps, [d], "--policy", "prefix", "--prefix-min-chars", "64")
    other = "Translate the following text into French, keeping the formatting exactly as is: "
    assert send(r, "a1", SYSTEM + "What is 2+2?").status_code == 200
    assert send(r, "b1", other + "Good morning").status_code == 200
    first_a, first_b = served_by(ps, "a1"), served_by(ps, "b1")
    assert first_a != first_b  # no shared prefix: least_load spreads them
    for i in range(4):  # least_load alone would alternate; affinity keeps each family home
        assert send(r, f"a{i + 2}", SYSTEM + f"What is {i}+{i}?").status_code == 200
        assert send(r, f"b{i + 2}", other + f"Good night {i}").status_code == 200
        assert served_by(ps, f"a{i + 2}") == first_a
        assert served_by(ps, f"b{i + 2}") == first_b
    # a shared prefix shorter than --prefix-min-chars does not pin: least_load decides
    for w in ps:
        idle(r, w)
    assert send(r, "c1", SYSTEM[:40] + "x" * 100).status_code == 200
    idle(r, ps[served_by(ps, "c1")])
    assert send(r, "c2", SYSTEM[:40] + "y" * 100).status_code == 200
    assert served_by(ps, "c1") != served_by(ps, "c2")
    # the affine worker is not ready: the prompt goes elsewhere instead of failing
    ps[first_a].ready = False
    wait_for(lambda: r.client.get("/ready").json()["ready_workers"]["prefill"] == 1)
    assert send(r, "a9", SYSTEM + "What is 9+9?").status_code == 200
    assert served_by(ps, "a9") == 1 - first_a


def test_prefix_affinity_on_chat_messages(workers: Any, router: Any) -> None:
    ps = [workers("prefill") for _ in range(3)]
    d = workers("decode")
    r = router(ps, [d], "--policy", "prefix")
    chosen = set()
    for i in range(5):
        body = {"model": "m", "rid": f"c{i}", "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": f"question {i}"}]}]}
        assert r.client.post("/v1/chat/completions", json=body).status_code == 200
        rid = d.received[-1].body["rid"]
        chosen.add(served_by(ps, rid))
    assert len(chosen) == 1


def test_prefix_index_is_bounded_and_prefers_the_longest_match() -> None:
    index = PrefixIndex(capacity=8, block=4)
    index.record("aaaabbbbcccc", "p0")
    index.record("aaaabbbbdddd", "p1")  # the latest owner of the shared "aaaabbbb" wins
    assert index.match("aaaabbbbcccczz", {"p0", "p1"}) == ("p0", 12)
    assert index.match("aaaabbbbxxxx", {"p0", "p1"}) == ("p1", 8)
    assert index.match("aaaabbbbxxxx", {"p0"}) == (None, 0)  # p1 is not a candidate
    assert index.match("zzzz", {"p0", "p1"}) == (None, 0)
    for i in range(10):
        index.record(f"{i:04d}" * 3, "p2")
    assert len(index) == 8  # least recently used prefixes went first
    assert index.match("aaaabbbbcccc", {"p0", "p1"}) == (None, 0)
    assert len(block_hashes("x" * 15, 4)) == 3  # only full blocks


def test_prefix_affinity_yields_to_an_overloaded_worker() -> None:
    policy = PrefixAffinity(min_chars=16, capacity=1024)
    ps = [Worker("prefill", "http://p0:1", 8998, ready=True),
          Worker("prefill", "http://p1:1", 8998, ready=True)]
    d = [Worker("decode", "http://d0:1", ready=True)]
    home, _ = policy.pick(ps, d, SYSTEM + "first")
    home.in_flight = IMBALANCE_SLACK - 1
    assert policy.pick(ps, d, SYSTEM + "second")[0] is home  # busy, but still affine
    home.in_flight = IMBALANCE_SLACK
    assert policy.pick(ps, d, SYSTEM + "third")[0] is not home  # too busy: least_load
    assert policy.pick(ps, d, None)[0] in ps  # no readable prompt: least_load


def kv(backend: str = "nixl", page_size: int = 16) -> dict[str, Any]:
    """A worker's `kv_transfer` as its /ready shows it."""
    layout = {"num_layers": 2, "page_size": page_size, "num_kv_heads": 3, "head_dim": 64,
              "dtype": "float32"}
    return {"backend": backend, "layout": layout}


def test_workers_that_cannot_exchange_kv_are_never_paired(workers: Any, router: Any) -> None:
    """Each prefill is paired only with decodes of the same KV layout and backend; when no
    pair is left, /ready and every request say what differs between whom."""
    ps = [workers("prefill") for _ in range(3)]
    ds = [workers("decode") for _ in range(2)]
    for w, spec in zip([*ps, *ds], [kv(), kv(page_size=8), kv("tcp"), kv(page_size=8), kv()],
                       strict=True):
        w.kv_transfer = spec
    r = router(ps, ds)
    assert r.client.get("/ready").json()["ready_workers"] == {"prefill": 3, "decode": 2}
    for i in range(8):
        assert send(r, f"r{i}").status_code == 200
    pairs = {(served_by(ps, f"r{i}"), served_by(ds, f"r{i}")) for i in range(8)}
    assert pairs == {(0, 1), (1, 0)}  # the tcp prefill has no partner: it gets nothing

    ps[0].ready = ps[1].ready = False  # only the tcp prefill is left
    wait_for(lambda: r.client.get("/ready").status_code == 503, what="/ready 503")
    message = r.client.get("/ready").json()["error"]["message"]
    assert f"prefill {ps[2].url} vs decode {ds[0].url}: KV backend tcp vs nixl" in message, message
    answer = send(r, "late")
    assert answer.status_code == 503 and "can send KV" in answer.json()["error"]["message"]
    assert not any(w.got("late") for w in [*ps, *ds])

    ps[2].kv_transfer = kv("tcp", page_size=8)
    ds[0].kv_transfer = kv(page_size=4)
    wait_for(lambda: "page_size 8 vs 4" in r.client.get("/ready").text, what="layout message")
