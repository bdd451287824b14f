"""Failures the client never sees, with real processes: a router in front of prefills and
decodes (tiny random Llama, tcp, a cluster key). A prefill killed with -9 under load (2P+1D,
prefill slowed by the `slow-prefill` plugin so that requests are caught mid-prefill) costs its
clients nothing: every request is retried on the other prefill. A decode killed with -9 while
it streams (1P+2D) costs them nothing either: every stream goes on from the other decode. Each
greedy output equals an undisturbed run's."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.auth.key import ENV
from tests.disagg.test_pd_failures import FAST, eventually, kv_free, metric
from tests.ports import free_ports
from tests.router.router_process import RouterProcess, start_router
from tests.server.server_process import ServerProcess
from tests.server.test_tp_serve import ends, followers

SLOW = ("--plugin", "tests.server.slow_prefill", "--attention-backend", "slow-prefill")
LONG = 1000  # tokens a stream generates: a few seconds, to be caught mid-way
ROOMY = ("--max-total-tokens", "16384")  # a decode holds 8 such streams
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima", "mike"]


@dataclass
class Deployment:
    prefills: list[ServerProcess]
    decodes: list[ServerProcess]
    router: RouterProcess

    def stop(self) -> None:
        self.router.stop()
        for srv in (*self.prefills, *self.decodes):
            if srv.proc.poll() is None:
                srv.stop()


def deploy(model: Path, log_dir: Path, prefills: int, decodes: int,
           prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = (),
           router_args: tuple[str, ...] = (), move_kv: bool = False,
           prefill_env: list[dict[str, str]] | None = None, backend: str = "tcp",
           first_decode_args: tuple[str, ...] = ()) -> Deployment:
    """`move_kv`: the decodes drain by moving KV (--move-kv-on-drain, on any free bootstrap
    port, as `baton up` starts them); `prefill_env`: each prefill's own environment variables;
    `first_decode_args`: decode 0's own, after `decode_args`."""
    env = {ENV: secrets.token_hex(32)}
    # every port at once, the decodes' KV ports too: ports picked one by one (or a KV receiver
    # on port 0 binding first) may take a port another server is about to bind
    picked = free_ports(2 * prefills + 2 * decodes)
    ports, http, kv = picked[:prefills], picked[prefills:-decodes], picked[-decodes:]
    moves = [("--move-kv-on-drain", "--bootstrap-port", "0") if move_kv else ()] * decodes
    ps = [ServerProcess("--role", "prefill", "--bootstrap-port", str(port), "--kv-transfer", backend,
                        *FAST, *prefill_args, log_path=log_dir / f"prefill{i}.log",
                        model=str(model), env={**env, **(prefill_env or [{}] * prefills)[i]},
                        port=http[i]) for i, port in enumerate(ports)]
    ds = [ServerProcess("--role", "decode", "--kv-transfer", backend, "--kv-port", str(kv[i]),
                        *moves[i], *FAST, *decode_args, *(() if i else first_decode_args),
                        log_path=log_dir / f"decode{i}.log",
                        model=str(model), env=env, port=http[prefills + i])
          for i in range(decodes)]
    for srv in (*ps, *ds):
        srv.wait_ready()
    router = start_router(*(a for p, port in zip(ps, ports, strict=True)
                            for a in ("--prefill", f"{p.url},{port}")),
                          *(a for d in ds for a in ("--decode", d.url)), "--policy", "least_load",
                          *router_args, log_path=log_dir / "router.log", env=env)
    return Deployment(ps, ds, router)


@pytest.fixture
def two_prefills(sharp_tiny_path: Path, tmp_path: Path) -> Iterator[Deployment]:
    # no prefix cache: the second run must prefill as slowly as the first
    # and the 3 s / 6 s test timeouts would fail a request that waits behind 8 s of slowed
    # prefill on the surviving prefill
    dep = deploy(sharp_tiny_path, tmp_path, 2, 1, (*SLOW, "--disable-prefix-cache",
                                                   "--bootstrap-timeout-s", "60"),
                 decode_args=("--waiting-timeout-s", "60"))
    yield dep
    dep.stop()


@pytest.fixture
def two_decodes(sharp_tiny_path: Path, tmp_path: Path, part: str) -> Iterator[Deployment]:
    """1P + 2D; for `part` "rank", decode 0 (the victim) runs two TP ranks."""
    victim = ("--tp", "2", "--tp-timeout-s", "10") if part == "rank" else ()
    dep = deploy(sharp_tiny_path, tmp_path, 1, 2, decode_args=ROOMY, first_decode_args=victim)
    yield dep
    dep.stop()


def prompt(i: int) -> str:
    """About 200 tokens, different for each i: ~1 s of slowed prefill each."""
    return " ".join(WORDS[(i * 7 + k * k) % len(WORDS)] for k in range(190))


STREAMED: dict[int, int] = {}  # request i -> tokens its stream has delivered so far
UNDISTURBED: dict[str, list[list[int]]] = {}  # a case's undisturbed outputs, for its params


async def ask(http: httpx.AsyncClient, url: str, i: int, stream: bool | None = None,
              max_new: int = 12) -> list[int]:
    """Request i's greedy output ids; streamed for odd i unless `stream` says (counting its
    tokens in STREAMED as they come). Any error fails the test."""
    body: dict[str, Any] = {"text": prompt(i), "stream": i % 2 == 1 if stream is None else stream,
                            "sampling_params": {"temperature": 0, "max_new_tokens": max_new,
                                                "ignore_eos": True}}
    if not body["stream"]:
        r = await http.post(f"{url}/generate", json=body)
        assert r.status_code == 200, r.text
        return list(r.json()["output_ids"])
    STREAMED[i] = 0
    ids: list[int] = []
    async for event in events(http, f"{url}/generate", body):
        ids += event["output_ids"]
        STREAMED[i] = len(ids)
    return ids


async def events(http: httpx.AsyncClient, url: str, body: dict[str, Any],
                 ) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a 200 stream; an error event fails the test."""
    async with http.stream("POST", url, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                yield event


async def ask_all(url: str, n: int, during: Any = None, **kw: Any) -> list[list[int]]:
    STREAMED.clear()
    async with httpx.AsyncClient(timeout=120) as http:
        calls = [asyncio.ensure_future(ask(http, url, i, **kw)) for i in range(n)]
        if during is not None:
            await during()
        return list(await asyncio.gather(*calls))


async def all_streaming(n: int, tokens: int = 5) -> None:
    """Until each of the `n` streams has delivered `tokens` tokens (and so is mid-way on its
    decode: least_load gives each decode half of them)."""
    deadline = time.monotonic() + 30
    while len(STREAMED) < n or min(STREAMED.values()) < tokens:
        assert time.monotonic() < deadline, f"not every stream got going: {STREAMED}"
        await asyncio.sleep(0.01)


def test_a_prefill_killed_mid_prefill_costs_its_clients_nothing(two_prefills: Deployment) -> None:
    dep = two_prefills
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
    eventually(lambda: kv_free(dep.decodes[0].url) and kv_free(dep.prefills[1].url))


async def all_going_on(within_s: float) -> None:
    """Until every unfinished stream has delivered another token (its decode may have died
    since: then it goes on from another)."""
    seen, deadline = dict(STREAMED), time.monotonic() + within_s
    while any(STREAMED[i] == n < LONG for i, n in seen.items()):
        stuck = {i: n for i, n in seen.items() if STREAMED[i] == n < LONG}
        assert time.monotonic() < deadline, f"streams stalled for {within_s} s: {stuck}"
        await asyncio.sleep(0.05)


def family(url: str, name: str) -> dict[str, float]:
    """Every sample of the counter `name` on /metrics, by its labels."""
    return {line.split()[0][len(name):]: float(line.split()[-1])
            for line in httpx.get(f"{url}/metrics").text.splitlines()
            if line.startswith((f"{name}{{", f"{name} "))}


def assert_streams_move(dep: Deployment, undisturbed: list[list[int]], disturb: Any) -> None:
    """8 long streams, `disturb` run once they are all mid-way: each equals its undisturbed
    run, the victim's (3 or more) moved to the other decode, and the survivors' KV is free."""
    disturbed = asyncio.run(ask_all(dep.router.url, 8, disturb, stream=True, max_new=LONG))
    assert disturbed == undisturbed
    moved = sum(family(dep.router.url, "baton_router_migrations_total").values())
    assert moved >= 3, "the streams on the victim did not move"
    eventually(lambda: kv_free(dep.decodes[1].url) and kv_free(dep.prefills[0].url))


@pytest.mark.parametrize("part", ["server", "scheduler", "rank"])
def test_a_decode_killed_mid_stream_costs_its_clients_nothing(two_decodes: Deployment, part: str) -> None:
    """8 streams, the victim holding several of them mid-way: each stream goes on from the
    other decode (the prefill computes prompt + what was streamed), every token exactly once.
    `scheduler`: only the victim's scheduler process dies; its HTTP process must fail the
    streams as a dead server would, not end them as if finished. `rank`: the victim runs two
    TP ranks and only its follower dies: the whole server goes, no rank left behind, and its
    streams go on elsewhere within 30 s."""
    dep = two_decodes
    if "decode-kill" not in UNDISTURBED:  # the same greedy tokens on any deployment: once
        UNDISTURBED["decode-kill"] = asyncio.run(ask_all(dep.router.url, 8, stream=True,
                                                         max_new=LONG))
    undisturbed = UNDISTURBED["decode-kill"]
    victim = dep.decodes[0]
    in_flight = f'baton_router_worker_in_flight{{role="decode",worker="{victim.url}"}}'
    ranks = [victim.scheduler_pid(), *followers(victim)] if part == "rank" else []

    async def kill_mid_stream() -> None:
        await all_streaming(8)
        assert await asyncio.to_thread(metric, dep.router.url, in_flight) >= 3
        if part == "server":
            victim.kill()
        elif part == "scheduler":
            os.kill(victim.scheduler_pid(), signal.SIGKILL)
        else:
            assert len(ranks) == 2, ranks
            os.kill(ranks[1], signal.SIGKILL)
        await all_going_on(30)

    assert_streams_move(dep, undisturbed, kill_mid_stream)
    if part == "rank":
        assert ends(victim, ranks) != 0
        assert "TP rank 1 exited" in victim.log()


def test_with_every_prefill_gone_a_local_decode_answers(sharp_tiny_path: Path, tmp_path: Path) -> None:
    """--fallback colocated: the decode (--allow-local-prefill) prefills itself, token-exact;
    the router says it is degraded and counts it."""
    dep = deploy(sharp_tiny_path, tmp_path, 1, 1, decode_args=("--allow-local-prefill",),
                 router_args=("--fallback", "colocated"))
    try:
        disaggregated = asyncio.run(ask_all(dep.router.url, 4))
        dep.prefills[0].kill()
        eventually(lambda: "degraded" in httpx.get(f"{dep.router.url}/ready").json())
        assert asyncio.run(ask_all(dep.router.url, 4)) == disaggregated
        assert metric(dep.router.url, "baton_router_pd_fallback_total") == 4
        assert "no ready prefill" in httpx.get(f"{dep.router.url}/ready").json()["degraded"]
        eventually(lambda: kv_free(dep.decodes[0].url))
    finally:
        dep.stop()


def test_a_draining_decode_hands_its_streams_on(sharp_tiny_path: Path, tmp_path: Path) -> None:
    """SIGTERM of a decode (without --move-kv-on-drain: tests/disagg/test_pd_move.py has it)
    streaming 3+ of 8 streams (grace 0.1 s): what the grace period leaves ends as a "drained"
    hand-over, not an error: its router moves each to the other decode (a migration, no
    upstream failure), so every stream completes, token-exact, and the decode exits cleanly."""
    dep = deploy(sharp_tiny_path, tmp_path, 1, 2,
                 decode_args=(*ROOMY, "--shutdown-grace-s", "0.1"))
    try:
        undisturbed = asyncio.run(ask_all(dep.router.url, 8, stream=True, max_new=LONG))
        victim = dep.decodes[0]

        async def drain_mid_stream() -> None:
            await all_streaming(8)
            victim.terminate()

        assert_streams_move(dep, undisturbed, drain_mid_stream)
        migrations = family(dep.router.url, "baton_router_migrations_total")
        assert set(migrations) == {'{reason="drained"}'}, migrations  # a hand-over, each
        assert family(dep.router.url, "baton_router_upstream_failures_total") == {}
        assert victim.proc.wait(30) == 0
    finally:
        dep.stop()
