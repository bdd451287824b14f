"""Two revisions serving at once (docs/rollouts.md): the router pairs a prefill only with a
decode of its own revision, which the KV layout in each worker's /ready carries, shows each
side's revision in /debug/pairs, and says "revision A vs B" when no pair of one revision is
left. Stand-in workers behind a real router (the handshake's own refusal, with real servers,
is in tests/disagg/test_pd_failures.py)."""

from __future__ import annotations

from typing import Any

from runtime.disagg.wire import KVLayout
from tests.router.conftest import wait_for
from tests.router.fake_worker import FakeWorker

GEN = {"text": "Hello", "sampling_params": {"max_new_tokens": 4}}


def of(worker: FakeWorker, revision: str) -> FakeWorker:
    """`worker`, showing `revision` in its /ready and its KV layout."""
    layout = KVLayout(num_layers=2, page_size=16, num_kv_heads=2, head_dim=8, dtype="float32",
                      revision=revision)
    worker.kv_transfer = {"backend": "tcp", "layout": layout.pairing()}
    worker.revision = revision
    return worker


def test_two_revisions_pair_only_within_each(workers: Any, router: Any) -> None:
    ps = [of(workers("prefill", bootstrap_port=9001 + i), rev) for i, rev in enumerate("ab")]
    ds = [of(workers("decode"), rev) for rev in "ab"]
    revision_of_port = {9001: "a", 9002: "b"}
    r = router(ps, ds, "--policy", "round_robin")
    for i in range(12):
        assert r.client.post("/generate", json={**GEN, "rid": f"q{i}"}).status_code == 200
    for d, rev in zip(ds, "ab", strict=True):  # each decode took KV from its revision only
        got = [revision_of_port[b["bootstrap_port"]] for b in (x.body for x in d.received)]
        assert got and set(got) == {rev}, (rev, got)
    pairs = r.client.get("/debug/pairs").json()["pairs"]
    assert sorted((p["prefill_revision"], p["decode_revision"]) for p in pairs) == [
        ("a", "a"), ("b", "b")], pairs

    # revision a's decode goes: its prefill has no partner and takes no request, the router
    # stays ready on revision b
    ds[0].ready = False
    served = len(ps[0].received)
    wait_for(lambda: _ready_decodes(r) == 1, what="decode a out of the router")
    for i in range(4):
        assert r.client.post("/generate", json={**GEN, "rid": f"s{i}"}).status_code == 200
    assert len(ps[0].received) == served

    # and with b's prefill gone too, no pair of one revision is left: 503, saying why
    ps[1].ready = False
    wait_for(lambda: r.client.get("/ready").status_code == 503, what="the router unready")
    why = r.client.get("/ready").text
    assert "revision a vs b" in why, why


def _ready_decodes(r: Any) -> float:
    for line in r.metrics().splitlines():
        if line.startswith('baton_router_ready_workers{role="decode"}'):
            return float(line.split()[-1])
    return -1.0
