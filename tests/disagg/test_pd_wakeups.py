"""Every step of the PD handoff wakes the scheduler loop that must act on it: the first token
that starts the prefill's transfer, the decode's page registration, the KV's arrival (with
its aux record, behind the pages). With the loop's poll ticks at 30 s (tests/disagg/no_poll_tick.py), requests through
a real pair still end within seconds; a handoff that waited for a tick would take 30 s."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.disagg.pd import Pair, pd_call, start_pair, stream_ids

PLUGIN = ("--plugin", "tests.disagg.no_poll_tick")
BOUND_S = 10.0  # a tick is 30 s; a request here takes well under a second


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def pair(request: pytest.FixtureRequest, tiny_path: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = start_pair(tmp_path_factory.mktemp(request.param), request.param, *PLUGIN,
                   model=str(tiny_path))
    yield p
    p.stop()


def body(pair: Pair, stream: bool) -> dict[str, object]:
    return {"text": "Hello there, how are", "stream": stream, **pair.fields(prompt={"text": "Hello there, how are"}),
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}


def test_handoffs_do_not_wait_for_the_poll_tick(pair: Pair) -> None:
    async def run() -> None:
        async with httpx.AsyncClient(timeout=BOUND_S) as http:
            for stream in (True, False, True):  # one by one: nothing else wakes the loops
                began = time.monotonic()
                prefill, decoded = await pd_call(http, pair, "/generate", body(pair, stream))
                assert prefill.status_code == 200
                ids = stream_ids(decoded) if stream else decoded["output_ids"]
                assert len(ids) == 6
                assert time.monotonic() - began < BOUND_S
            results = await asyncio.gather(*(pd_call(http, pair, "/generate", body(pair, False))
                                             for _ in range(4)))
            assert all(len(d["output_ids"]) == 6 for _, d in results)

    asyncio.run(run())
