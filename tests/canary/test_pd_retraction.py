"""Retraction through PD under the KV canary (a real prefill + decode pair on loopback, the sharp
tiny Llama, greedy, `--kv-canary raise --kv-canary-sweep 1` on both sides, tag and byte checks).

The decode's pool is too small for what it admits: its running requests outgrow it and the
newest are retracted (`DecodeManager.make_room`): their pages are freed and they go back to
the decode's own waiting queue, to be prefilled again there from prompt + output so far (the
prefill server is not asked again; its role never decodes, so it never retracts). The prompts
share prefixes and come twice, so the prefill's prefix cache serves part of them.

Asserted: the decode did retract (`baton_retractions_total` > 0, so this cannot pass
vacuously), both sides checked KV and found nothing wrong, every output equals a colocated
server's undisturbed greedy output token for token, and both pools end empty.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.canary.test_pd_canary import UNLIMITED, canary_error, wait_empty
from tests.disagg.pd import Pair, pd_call, start_pair, stream_ids
from tests.server.server_process import ServerProcess, start_server
from tests.server.test_metrics import metric

MAX_NEW = 40
CANARY = ("--kv-canary", "raise", "--kv-canary-sweep", "1", "--kv-canary-bytes", "all",
          "--page-size", "4")
# the longest request (36 + 40 tokens) fits alone; a dozen admitted at once do not
DECODE_POOL = ("--max-total-tokens", "192", "--waiting-timeout-s", "120",
               "--bootstrap-timeout-s", "120")


def prompts(n: int, seed: int) -> list[list[int]]:
    """Four 16-token stems (four pages) with tails of 3 to 20 tokens; each prompt twice."""
    rng = random.Random(seed)
    stems = [[rng.randrange(100, 40000) for _ in range(16)] for _ in range(4)]
    once = [stems[i % 4] + [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 21))]
            for i in range(n)]
    return once + once


def sampling() -> dict[str, Any]:
    return {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


BATCH = prompts(24, seed=7)


@pytest.fixture(scope="module")
def reference(sharp_tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """BATCH's greedy outputs from a colocated server with room for everyone at once (nothing
    retracted)."""
    srv = start_server("--page-size", "4", "--max-total-tokens", "16384", model=str(sharp_tiny_path),
                       log_path=tmp_path_factory.mktemp("retract-ref") / "server.log")
    try:
        outputs = colocated_outputs(srv, BATCH)
        text = httpx.get(f"{srv.url}/metrics").text
        assert metric(text, "baton_retractions_total") == 0, "the reference is undisturbed"
    finally:
        assert srv.stop() == 0, srv.log()
    return outputs


DECODE_CACHE = ("--no-enable-overlap", "--no-disable-prefix-cache")


@pytest.fixture(scope="module", params=[("--enable-overlap",), DECODE_CACHE],
                ids=["overlap", "no-overlap-decode-cache"])
def pair(request: pytest.FixtureRequest, sharp_tiny_path: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """The second kind re-prefills a retracted request from the decode's own prefix cache."""
    p = start_pair(tmp_path_factory.mktemp("pd-retract"), "tcp", *CANARY,
                   model=str(sharp_tiny_path), decode_extra=(*DECODE_POOL, *request.param))
    yield p
    p.stop()


def colocated_outputs(srv: ServerProcess, batch: list[list[int]]) -> list[list[int]]:
    async def one(http: httpx.AsyncClient, ids: list[int]) -> list[int]:
        resp = await http.post("/generate", json={"input_ids": ids, "sampling_params": sampling()})
        assert resp.status_code == 200, resp.text
        return list(resp.json()["output_ids"])

    async def every() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
            return list(await asyncio.gather(*(one(http, ids) for ids in batch)))
    return asyncio.run(every())


def pd_outputs(pair: Pair, batch: list[list[int]]) -> list[list[int]]:
    async def one(http: httpx.AsyncClient, i: int, ids: list[int]) -> list[int]:
        body = {"input_ids": ids, "stream": i % 2 == 0, **pair.fields(prompt={"input_ids": ids}),
                "sampling_params": sampling()}
        prefill, decoded = await pd_call(http, pair, "/generate", body)
        assert prefill.status_code == 200, prefill.text
        assert canary_error(decoded) is None, canary_error(decoded)
        return stream_ids(decoded) if isinstance(decoded, list) else list(decoded["output_ids"])

    async def every() -> list[list[int]]:
        async with httpx.AsyncClient(timeout=300, limits=UNLIMITED) as http:
            return list(await asyncio.gather(*(one(http, i, ids) for i, ids in enumerate(batch))))
    return asyncio.run(every())


def test_retracted_decode_requests_resume_exactly_and_raise_nothing(
        pair: Pair, reference: list[list[int]]) -> None:
    half = len(BATCH) // 2
    got = pd_outputs(pair, BATCH[:half])
    got += pd_outputs(pair, BATCH[half:])  # the repeats, in a second wave: cached prefixes
    for i, (g, w) in enumerate(zip(got, reference, strict=True)):
        assert g == w, f"prompt {i}: PD {g} != colocated {w}"
    wait_empty(pair)
    decode = httpx.get(f"{pair.decode.url}/metrics").text
    assert metric(decode, "baton_retractions_total") > 0, "the decode pool was meant to run short"
    if httpx.get(f"{pair.decode.url}/debug/stats").json()["prefix_cache"] is not None:
        # retracted requests resumed from what the decode's own cache kept of them
        assert metric(decode, "baton_prefix_cache_hit_tokens_total") > 0
    for srv in (pair.prefill, pair.decode):
        text = httpx.get(f"{srv.url}/metrics").text
        assert metric(text, "baton_kv_canary_checks_total") > 0, srv.url
        assert "baton_kv_canary_violations_total{" not in text, srv.url
    prefill = httpx.get(f"{pair.prefill.url}/metrics").text
    assert metric(prefill, "baton_prefix_cache_hit_tokens_total") > 0, "shared prefixes were reused"
    # every request a prefill takes is a hand-off, which never joins its decode batch
    assert metric(prefill, "baton_retractions_total") == 0
