"""PD with fp8 KV pages on both sides (`--kv-cache-dtype fp8_e4m3`, over tcp and nixl): the pages
move as bytes (half a bf16 page's) under the same scales (their digest in the KV layout), so
greedy output equals a colocated fp8-KV engine's token for token; the KV canary's byte checksums (`raise`, `all`) check the fp8 pages
on arrival and catch the pages the prefill corrupts before sending (`kv_before_send`: a sign
bit flipped); /server_info names the KV dtype."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime import Engine
from tests.canary.test_pd_canary import caught_or_exact, injections, run, wait_empty
from tests.disagg.pd import Pair, start_pair

MAX_NEW = 8
FP8 = ("--kv-cache-dtype", "fp8_e4m3", "--page-size", "4")


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def pair(request: pytest.FixtureRequest, sharp_tiny_path: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = start_pair(tmp_path_factory.mktemp("pd-fp8"), request.param, *FP8, "--kv-canary", "raise",
                   "--kv-canary-bytes", "all", model=str(sharp_tiny_path),
                   prefill_extra=("--perturb", "kv_before_send=0.25", "--perturb-seed", "5"))
    yield p
    p.stop()


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(5, 40))] for _ in range(24)]


@pytest.fixture(scope="module")
def colocated(sharp_tiny_path: Path) -> list[list[int]]:
    """A colocated fp8-KV engine's greedy tokens for prompts()."""
    engine = Engine(model=str(sharp_tiny_path), kv_cache_dtype="fp8_e4m3", page_size=4)
    try:
        return [r["output_ids"] for r in engine.generate(
            prompts(), {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True})]
    finally:
        engine.shutdown()


def test_pd_with_fp8_pages_equals_colocated_fp8_and_the_canary_catches_corrupt_pages(
        pair: Pair, colocated: list[list[int]]) -> None:
    info = httpx.get(f"{pair.decode.url}/server_info").json()
    assert info["kv_cache_dtype"] == "fp8_e4m3" and info["dtype"] == "float32"
    layout = info["kv_transfer"]["layout"]
    assert layout["dtype"] == "float8_e4m3fn" and len(layout["kv_scales"]) == 16
    bodies: list[dict[str, Any]] = [
        {"input_ids": ids, "stream": i % 2 == 0, **pair.fields(prompt={"input_ids": ids}),
         "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}}
        for i, ids in enumerate(prompts())]
    results = asyncio.run(run(pair, bodies))
    caught = caught_or_exact(results, colocated)
    wait_empty(pair)
    sent = injections(pair.prefill.url).get("kv_before_send", 0)
    assert sent == caught and 0 < caught < len(bodies), (sent, caught)
