"""Token oracle through PD (seed 002): with `token_oracle` on both roles, 64 concurrent requests
each return exactly their own oracle sequence, so no request got another's first token or room."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.canary.oracle import oracle_sequence
from tests.disagg.pd import Pair, pd_call, start_pair, stream_ids

VOCAB = 49152  # SmolLM2's tokenizer, kept by the tiny model


@pytest.fixture(scope="module")
def pair(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = start_pair(tmp_path_factory.mktemp("pd-oracle"), "tcp", "--sampler-backend",
                   "token_oracle", "--max-running-requests", "64", model=str(tiny_path))
    yield p
    p.stop()


async def run(pair: Pair, bodies: list[dict[str, Any]]) -> list[tuple[httpx.Response, Any]]:
    async with httpx.AsyncClient(timeout=120) as http:
        return list(await asyncio.gather(*(pd_call(http, pair, "/generate", b) for b in bodies)))


def bodies_for(pair: Pair, n: int, seed: int, max_prompt: int = 90) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    bodies = []
    for i in range(n):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(1, max_prompt))]
        bodies.append({"input_ids": prompt, "stream": i % 2 == 0, **pair.fields(rng.getrandbits(63), prompt={"input_ids": prompt}),
                       "sampling_params": {"max_new_tokens": rng.randrange(1, 24), "ignore_eos": True}})
    return bodies


def check_oracle(pair: Pair, bodies: list[dict[str, Any]]) -> None:
    for body, (prefill, decoded) in zip(bodies, asyncio.run(run(pair, bodies)), strict=True):
        n, room = body["sampling_params"]["max_new_tokens"], body["bootstrap_room"]
        want = oracle_sequence(room, len(body["input_ids"]), n, VOCAB)
        assert prefill.status_code == 200, prefill.text
        assert prefill.json()["output_ids"] == want[:1]
        got = stream_ids(decoded) if isinstance(decoded, list) else decoded["output_ids"]
        assert got == want, f"room {room}: got {got}, oracle {want}"
    for srv in (pair.prefill, pair.decode):
        assert httpx.get(f"{srv.url}/debug/stats").json()["kv_all_free"]


def test_64_concurrent_requests_each_get_their_own_oracle_sequence(pair: Pair) -> None:
    check_oracle(pair, bodies_for(pair, 64, seed=7))


def test_a_full_decode_pool_makes_requests_wait_never_fail(
    tiny_path: Path, tmp_path: Path
) -> None:
    """Decode's pool holds ~6 of these requests at once: the rest wait in its prealloc queue
    (and their prefill side in its bootstrap queue), then all finish with their own tokens."""
    pair = start_pair(tmp_path, "tcp", "--sampler-backend", "token_oracle", model=str(tiny_path),
                      decode_extra=("--max-total-tokens", "512", "--page-size", "16"))
    try:
        check_oracle(pair, bodies_for(pair, 32, seed=11, max_prompt=60))
    finally:
        pair.stop()
