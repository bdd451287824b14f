"""The cache-aware router on real workers: 2 prefills whose pools hold about three system
prompts each, 1 decode, a router following the prefills' KV events. 4 distinct ~1,000-token
system prompts x 16 questions, shuffled, one at a time: cache_aware reaches >= 90% of the ideal
cached tokens (every repeat hits), reading the chats with the tokenizer files a worker serves
(`--tokenizer workers`); round_robin spreads each prompt over both prefills and their caches
thrash. The router's index equals the workers' caches after the run, and again after a
prefill is killed and restarted (its stale blocks dropped, its new ones learnt)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.tokenizer import chat_prompt_ids, load_tokenizer
from tests.disagg.pd import Pair, start_pair
from tests.ports import free_port
from tests.router.conftest import wait_for
from tests.router.router_process import RouterProcess, start_router
from tests.server.server_process import ServerProcess
from tests.server.test_kv_events import cached

PAGE = 16
POOL = "3072"  # tokens: about three system prompts and the request being prefilled
WORDS = ["valve", "pump", "filter", "hose", "gasket", "sensor", "relay", "bracket", "cable", "panel", "switch", "motor", "gear", "spring", "clamp", "nozzle", "seal", "manifold", "regulator", "coupling", "bearing", "piston", "shaft", "rotor"]


def system_prompt(k: int) -> str:
    rng = random.Random(k)
    return f"Manual {k}. " + " ".join(rng.choice(WORDS) for _ in range(900))


@pytest.fixture(scope="module")
def fleet(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("cache-router")
    pool = ("--max-total-tokens", POOL)
    pair = start_pair(tmp, "tcp", *pool, model=str(tiny_path))
    bport = free_port()
    second = ServerProcess("--role", "prefill", "--bootstrap-port", str(bport), "--kv-transfer",
                           "tcp", *pool, log_path=tmp / "prefill1.log", model=str(tiny_path),
                           env=pair.env)
    try:
        second.wait_ready()
        yield {"pair": pair, "second": second, "bport": bport, "tmp": tmp, "model": tiny_path}
    finally:
        fleet_stop(pair, second)


def fleet_stop(pair: Pair, second: ServerProcess) -> None:
    pair.stop()
    if second.proc.poll() is None:
        second.stop()


def router_for(fleet: dict[str, Any], policy: str, tokenizer: str | None = None) -> RouterProcess:
    """`tokenizer`: the router's --tokenizer (default: the model's folder)."""
    pair: Pair = fleet["pair"]
    log = fleet["tmp"] / f"router-{policy}.log"
    router = start_router("--prefill", f"{pair.prefill.url},{pair.bootstrap_port}",
                          "--prefill", f"{fleet['second'].url},{fleet['bport']}",
                          "--decode", pair.decode.url, "--policy", policy,
                          "--tokenizer", tokenizer or str(fleet["model"]), log_path=log,
                          env=pair.env)
    if tokenizer == "workers":  # it asks the workers for the tokenizer files once they serve
        wait_for(lambda: "tokenizer from worker" in log.read_text(), 20)
    return router


def workload() -> list[list[dict[str, str]]]:
    rng = random.Random(3)
    convs = [[{"role": "system", "content": system_prompt(k)},
              {"role": "user", "content": f"Question {q}: which part fails first, and why?"}]
             for k in range(4) for q in range(16)]
    rng.shuffle(convs)
    return convs


def ideal(model: Path, convs: list[list[dict[str, str]]]) -> int:
    """Cached tokens if every prompt found everything an earlier one computed (full pages)."""
    tok = load_tokenizer(model)
    seen: list[list[int]] = []
    total = 0
    for messages in convs:
        ids = chat_prompt_ids(tok, messages)
        common = max((shared(ids, s) for s in seen), default=0)
        total += min(common, len(ids) - 1) // PAGE * PAGE
        seen.append(ids)
    return total


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run(router: RouterProcess, convs: list[list[dict[str, str]]]) -> int:
    total = 0
    with httpx.Client(base_url=router.url, timeout=120) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        for messages in convs:
            r = http.post("/v1/chat/completions", json={
                "model": model, "messages": messages, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            total += r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return total


def flush(*servers: ServerProcess) -> None:
    for srv in servers:
        assert httpx.post(f"{srv.url}/flush_cache", timeout=30).status_code == 200


def index_matches(router: RouterProcess, servers: list[ServerProcess]) -> bool:
    view = httpx.get(f"{router.url}/debug/kv_index", timeout=10).json()["workers"]
    for srv in servers:
        with httpx.Client(base_url=srv.url, timeout=10) as client:
            truth = cached(client)
        if srv.url not in view or set(view[srv.url]["blocks"]) != truth:
            return False
    return True


def test_cache_aware_routes_to_the_cache_and_round_robin_thrashes(fleet: dict[str, Any]) -> None:
    convs = workload()
    best = ideal(fleet["model"], convs)
    prefills = [fleet["pair"].prefill, fleet["second"]]
    results = {}
    for policy in ("round_robin", "cache_aware"):
        flush(*prefills)
        # cache_aware reads the chats with the tokenizer a worker serves (as in a cluster,
        # where the router has not got an hf:// or pvc:// model): without it, it could not
        # match text prompts at all
        router = router_for(fleet, policy, "workers" if policy == "cache_aware" else None)
        try:
            results[policy] = run(router, convs)
            if policy == "cache_aware":
                wait_for(lambda r=router: index_matches(r, prefills), 20)  # type: ignore[misc]
        finally:
            assert router.stop() == 0
    print(f"ideal {best}, cached: {results}")
    assert results["cache_aware"] >= 0.9 * best, results
    assert results["round_robin"] < 0.8 * results["cache_aware"], results


def test_the_index_forgets_a_killed_prefill_and_learns_its_successor(
        fleet: dict[str, Any]) -> None:
    convs = workload()[:12]
    pair: Pair = fleet["pair"]
    router = router_for(fleet, "cache_aware")
    try:
        run(router, convs)
        second: ServerProcess = fleet["second"]
        wait_for(lambda: index_matches(router, [pair.prefill, second]), 20)
        before = httpx.get(f"{router.url}/debug/kv_index").json()["workers"][second.url]
        second.kill()
        wait_for(lambda: second.url not in httpx.get(
            f"{router.url}/debug/kv_index").json()["workers"], 20)
        fleet["second"] = second = ServerProcess(
            "--role", "prefill", "--bootstrap-port", str(fleet["bport"]), "--kv-transfer", "tcp",
            "--max-total-tokens", POOL, port=second.port, log_path=fleet["tmp"] / "prefill1b.log",
            model=str(fleet["model"]), env=pair.env)
        second.wait_ready()
        wait_for(lambda: index_matches(router, [pair.prefill, second]), timeout=30)
        after = httpx.get(f"{router.url}/debug/kv_index").json()["workers"][second.url]
        assert after["instance"] != before["instance"] and len(after["blocks"]) < len(before["blocks"])
        run(router, convs)
        wait_for(lambda: index_matches(router, [pair.prefill, second]), 20)
    finally:
        assert router.stop() == 0
