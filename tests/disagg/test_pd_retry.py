"""Failures the client never sees, with real processes: a router in front of two prefills and
a decode (tiny random Llama, tcp, a cluster key; prefill slowed by the `slow-prefill` plugin so
that requests are caught mid-prefill). A prefill killed with -9 under load costs its clients
nothing: every request is retried on the other prefill and its greedy output equals an
undisturbed run's."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.auth.key import ENV
from tests.disagg.pd import read_stream
from tests.disagg.test_pd_failures import FAST, eventually, kv_free, metric
from tests.router.router_process import RouterProcess, start_router
from tests.server.server_process import ServerProcess, free_port

SLOW = ("--plugin", "tests.server.slow_prefill", "--attention-backend", "slow-prefill")
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima", "mike"]


@dataclass
class Deployment:
    prefills: list[ServerProcess]
    decode: ServerProcess
    router: RouterProcess

    def stop(self) -> None:
        self.router.stop()
        for srv in (*self.prefills, self.decode):
            if srv.proc.poll() is None:
                srv.stop()


@pytest.fixture
def deployment(tiny_path: Path, tmp_path: Path) -> Iterator[Deployment]:
    env = {ENV: secrets.token_hex(32)}
    ports = [free_port(), free_port()]
    prefills = [ServerProcess("--role", "prefill", "--bootstrap-port", str(port), "--kv-transfer",
                              "tcp", *FAST, *SLOW, log_path=tmp_path / f"prefill{i}.log",
                              model=str(tiny_path), env=env) for i, port in enumerate(ports)]
    decode = ServerProcess("--role", "decode", "--kv-transfer", "tcp", "--kv-port", "0", *FAST,
                           log_path=tmp_path / "decode.log", model=str(tiny_path), env=env)
    for srv in (*prefills, decode):
        srv.wait_ready()
    router = start_router(*(a for p, port in zip(prefills, ports, strict=True)
                            for a in ("--prefill", f"{p.url},{port}")),
                          "--decode", decode.url, "--policy", "least_load",
                          log_path=tmp_path / "router.log", env=env)
    dep = Deployment(prefills, decode, router)
    yield dep
    dep.stop()


def prompt(i: int) -> str:
    """About 200 tokens, different for each i: ~1 s of slowed prefill each."""
    return " ".join(WORDS[(i * 7 + k * k) % len(WORDS)] for k in range(190))


async def ask(http: httpx.AsyncClient, url: str, i: int) -> list[int]:
    """Request i's greedy output ids; streamed for odd i. Any error fails the test."""
    body: dict[str, Any] = {"text": prompt(i), "stream": i % 2 == 1, "sampling_params": {
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}
    if not body["stream"]:
        r = await http.post(f"{url}/generate", json=body)
        assert r.status_code == 200, r.text
        return list(r.json()["output_ids"])
    async with http.stream("POST", f"{url}/generate", json=body) as r:
        assert r.status_code == 200, await r.aread()
        events = await read_stream(r)
    assert not any("error" in e for e in events), events
    return [t for e in events for t in e["output_ids"]]


async def ask_all(url: str, n: int, during: Any = None) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=120) as http:
        calls = [asyncio.ensure_future(ask(http, url, i)) for i in range(n)]
        if during is not None:
            await during()
        return list(await asyncio.gather(*calls))


def test_a_prefill_killed_mid_prefill_costs_its_clients_nothing(deployment: Deployment) -> None:
    dep = deployment
    undisturbed = asyncio.run(ask_all(dep.router.url, 8))
    assert all(len(out) == 12 for out in undisturbed)
    victim = dep.prefills[0]
    in_flight = f'baton_router_worker_in_flight{{role="prefill",worker="{victim.url}"}}'

    async def kill_mid_prefill() -> None:
        # the victim holds several requests whose KV it has not sent (its reply is pending)
        deadline = time.monotonic() + 30
        while True:
            if await asyncio.to_thread(metric, dep.router.url, in_flight) >= 3:
                break
            assert time.monotonic() < deadline, "the victim never had 3 requests in flight"
            await asyncio.sleep(0.02)
        victim.kill()

    disturbed = asyncio.run(ask_all(dep.router.url, 8, kill_mid_prefill))
    assert disturbed == undisturbed
    retries = metric(dep.router.url, 'baton_router_retries_total{reason="broken",side="prefill"}')
    assert retries >= 1, "no request was on the killed prefill"
    assert metric(dep.router.url, 'baton_router_requests_total{endpoint="/generate",status="200"}') == 16
    eventually(lambda: kv_free(dep.decode.url) and kv_free(dep.prefills[1].url))
