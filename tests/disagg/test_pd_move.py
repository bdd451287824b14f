"""Drain by moving KV, with real processes (docs/disaggregation.md "Moving a request"): a
decode started with --move-kv-on-drain that gets SIGTERM while it streams hands each stream to
the other decode with its KV (pages, newest token, seed) over the KV transfer path. Nothing is
recomputed: the prefill sees no request for them. Each stream goes on token-exact, every token
once (/generate streams, and chat streams whose `stream_interval` leaves tokens due at the move),
with one finish and one usage; the KV canary (raise) finds every moved slot the stream's own;
the draining decode exits 0 and the survivors' KV is free. A draining decode of two TP ranks
moves its streams to a one-rank decode the same way, and fp8 KV pages move as any others."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.disagg.test_pd_failures import eventually, kv_free, metric
from tests.disagg.test_pd_retry import (
    LONG,
    ROOMY,
    STREAMED,
    all_streaming,
    ask,
    deploy,
    events,
    family,
    prompt,
)


async def chat(http: httpx.AsyncClient, url: str, i: int) -> dict[str, Any]:
    """Chat stream i (5 tokens an event): its text, finish reasons and usage, as the client got
    them, counting its events in STREAMED."""
    body = {"model": "m", "messages": [{"role": "user", "content": prompt(i)}], "stream": True,
            "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream_interval": 5,
            "stream_options": {"include_usage": True}}
    STREAMED[i], text, finishes, usage = 0, "", [], []
    async for event in events(http, f"{url}/v1/chat/completions", body):
        for c in event["choices"]:
            text += c["delta"].get("content") or ""
            finishes += [c["finish_reason"]] if c["finish_reason"] else []
            STREAMED[i] += 5
        usage += [event["usage"]] if event.get("usage") else []
    # cached tokens: the prefill's cache, which the second run hits; not part of the comparison
    cached = [u.pop("prompt_tokens_details")["cached_tokens"] for u in usage]
    return {"text": text, "finishes": finishes, "usage": usage, "cached": cached}


async def streams(url: str, during: Any = None) -> list[Any]:
    """4 /generate streams (their ids) and 4 chat streams, `during` run once they started."""
    STREAMED.clear()
    async with httpx.AsyncClient(timeout=120) as http:
        calls = [asyncio.ensure_future(ask(http, url, i, stream=True, max_new=LONG) if i % 2
                                       else chat(http, url, i)) for i in range(8)]
        if during is not None:
            await during()
        return list(await asyncio.gather(*calls))


NAMED = ("--served-model-name", "m")
CANARY = ("--kv-canary", "raise", "--enable-overlap")  # overlap: the fence a GPU needs


def requests_done(url: str) -> float:
    """Every request the worker finished (any status)."""
    return sum(float(line.split()[-1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
               if line.startswith("baton_requests_total{"))


@pytest.mark.parametrize(("backend", "victim_tp"), [("tcp", 2), ("nixl", 1)],
                         ids=["tcp-tp2-victim", "nixl-fp8-kv"])
def test_a_draining_decode_moves_its_streams_with_their_kv(sharp_tiny_path: Path, tmp_path: Path,
                                                           backend: str, victim_tp: int) -> None:
    """Over tcp the draining decode runs two TP ranks and the taker one: each rank's KV heads
    leave as a share (runtime/disagg/shares.py), both into the taker's pages. Over nixl every
    server keeps fp8 KV pages (--kv-cache-dtype fp8_e4m3): they move as bytes with their
    scales, and the streams equal their undisturbed fp8 runs."""
    if backend == "nixl":
        pytest.importorskip("nixl")  # a decode's own nixl agent writes into the other's pool
    victim = ("--tp", str(victim_tp)) if victim_tp > 1 else ()
    pages = ("--kv-cache-dtype", "fp8_e4m3") if backend == "nixl" else ()
    dep = deploy(sharp_tiny_path, tmp_path, 1, 2, prefill_args=(*NAMED, *CANARY, *pages),
                 decode_args=(*ROOMY, *NAMED, *CANARY, *pages), move_kv=True, backend=backend,
                 first_decode_args=victim)
    try:
        undisturbed = asyncio.run(streams(dep.router.url))
        victim, prefill, router = dep.decodes[0], dep.prefills[0], dep.router.url
        before = requests_done(prefill.url)
        on_victim: list[float] = []
        in_flight = f'baton_router_worker_in_flight{{role="decode",worker="{victim.url}"}}'

        async def drain_mid_stream() -> None:
            await all_streaming(8)
            on_victim.append(await asyncio.to_thread(metric, router, in_flight))
            victim.terminate()

        disturbed = asyncio.run(streams(router, drain_mid_stream))
        chats = disturbed[::2]
        # a moved stream's usage still counts the prompt tokens the prefill found cached
        assert all(c.pop("cached")[0] > 0 for c in chats)
        for c in undisturbed[::2]:
            c.pop("cached")
        assert disturbed == undisturbed  # token-exact, each token once, one finish and usage
        assert all(len(c["finishes"]) == len(c["usage"]) == 1 for c in chats)
        assert on_victim[0] >= 3, "too few streams on the victim to show anything"
        moved = metric(router, "baton_kv_migrations_total")
        assert moved == on_victim[0], "every stream on the victim moved with its KV"
        migrations = family(router, "baton_router_migrations_total")
        assert migrations == {'{reason="kv_move"}': moved}, migrations  # a hand-over, each
        assert family(router, "baton_router_upstream_failures_total") == {}  # none a failure
        assert requests_done(prefill.url) - before == 8  # the first prefills only
        # the moved KV is the streams' own: its slot tags checked on arrival and every step
        taker = dep.decodes[1].url
        assert metric(taker, "baton_kv_canary_checks_total") > 0
        assert sum(float(line.split()[-1]) for line in httpx.get(f"{taker}/metrics").text
                   .splitlines() if line.startswith("baton_kv_canary_violations_total")) == 0
        assert victim.proc.wait(30) == 0
        eventually(lambda: kv_free(dep.decodes[1].url) and kv_free(prefill.url))
    finally:
        dep.stop()
