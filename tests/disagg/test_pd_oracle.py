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


def test_64_concurrent_requests_each_get_their_own_oracle_sequence(pair: Pair) -> None:
    rng = random.Random(7)
    bodies = []
    for i in range(64):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 90))]
        body = {"input_ids": prompt, "stream": i % 2 == 0, **pair.fields(rng.getrandbits(63)),
                "sampling_params": {"max_new_tokens": rng.randrange(1, 24), "ignore_eos": True}}
        bodies.append(body)
    for body, (prefill, decoded) in zip(bodies, asyncio.run(run(pair, bodies)), strict=True):
        n, room = body["sampling_params"]["max_new_tokens"], body["bootstrap_room"]
        want = oracle_sequence(room, len(body["input_ids"]), n, VOCAB)
        assert prefill.status_code == 200, prefill.text
        assert prefill.json()["output_ids"] == want[:1]
        got = stream_ids(decoded) if isinstance(decoded, list) else decoded["output_ids"]
        assert got == want, f"room {room}: got {got}, oracle {want}"
    for srv in (pair.prefill, pair.decode):
        assert httpx.get(f"{srv.url}/debug/stats").json()["kv_all_free"]
