"""The freeze scenario (issue: KV plane integrity), with real processes: prefill A holds rooms
on decode D, then stops answering D (SIGSTOP of its whole process group, of its scheduler process
only, or a partition of its bootstrap port) long enough for D to declare it gone and end those
rooms; other requests, through prefill B, then run on D; then A comes back and finishes the
rooms D gave up on. Whatever A writes late must land in no page another request owns: every
bystander's greedy output equals its undisturbed run, A's own requests end with a clear error,
and afterwards every pool is empty. The partition is the deterministic one: A keeps running,
prefills and writes while D's cancels cannot reach it, so the late write is always attempted and
the test asserts D refused it (tcp) or contained it in quarantined pages (nixl)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.auth.key import ENV, ClusterKey
from runtime.auth.ticket import sign
from runtime.protocol import prompt_digest
from tests.disagg.partition import Partition
from tests.disagg.pd import instance_id, tiny_model
from tests.disagg.test_pd_failures import eventually, kv_free, metric
from tests.ports import free_port
from tests.server.server_process import ServerProcess

# fast heartbeats; timeouts long enough for the bystanders to wait out a quarantine
FLAGS = ("--heartbeat-interval-s", "0.5", "--heartbeat-misses", "2", "--bootstrap-timeout-s", "60",
         "--waiting-timeout-s", "60")
VICTIM = " ".join(f"victim{i} speaks of apples and of rivers" for i in range(14))  # ~120 tokens
BYSTANDERS = [f"Bystander {i}: " + " ".join(["the quick brown fox jumps"] * 12) for i in range(6)]
NEW_TOKENS = 300  # bystanders still decode when A's late write comes


@dataclass
class Trio:
    a: ServerProcess
    b: ServerProcess
    d: ServerProcess
    a_bootstrap: int
    b_bootstrap: int
    backend: str
    key: str

    def servers(self) -> list[ServerProcess]:
        return [self.a, self.b, self.d]

    def body(self, text: str, prefill: ServerProcess, bootstrap_port: int, room: int, *,
             stream: bool = False, new_tokens: int = 8) -> dict[str, Any]:
        """What the router sends for a (prefill, D) pair, its signed room ticket included."""
        rid = f"r{room}"
        ticket = sign(ClusterKey(self.key.encode()), room, rid, instance_id(prefill),
                      "127.0.0.1", bootstrap_port, instance_id(self.d),
                      prompt_digest({"text": text}))
        return {"text": text, "rid": rid, "stream": stream, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": bootstrap_port, "bootstrap_room": room,
                "bootstrap_ticket": ticket, "sampling_params": {
                    "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}


@pytest.fixture(scope="module")
def sharp_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with large weights: its greedy tokens follow the KV they attend to
    (with the default small ones, a bystander given another prompt's KV may still answer the
    same tokens, and the test could not see a late write)."""
    from tests.gpu.conftest import model_files

    return tiny_model(model_files(), tmp_path_factory.mktemp("sharp-llama"), init_range=0.5)


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def trio(request: pytest.FixtureRequest, sharp_path: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    backend = request.param
    if backend == "nixl":
        pytest.importorskip("nixl")
    logs = tmp_path_factory.mktemp(f"freeze-{backend}")
    ports, key = (free_port(), free_port()), secrets.token_hex(32)
    common = ("--kv-transfer", backend, *FLAGS)
    a, b = (ServerProcess("--role", "prefill", "--bootstrap-port", str(port), *common,
                          model=str(sharp_path), log_path=logs / f"prefill-{name}.log",
                          env={ENV: key})
            for name, port in zip("ab", ports, strict=True))
    # its allocator hands out the pages freed last first: the bystanders' prompts get the pages
    # the victims held, if they are freed
    d = ServerProcess("--role", "decode", "--kv-port", "0", *common, model=str(sharp_path),
                      log_path=logs / "decode.log", env={ENV: key})
    t = Trio(a, b, d, *ports, backend, key)
    try:
        for srv in t.servers():
            srv.wait_ready()
        yield t
    finally:
        for srv in t.servers():
            if srv.proc.poll() is None:
                os.killpg(srv.proc.pid, signal.SIGCONT)
                srv.stop()


async def bystanders(http: httpx.AsyncClient, t: Trio, first: int,
                     started: asyncio.Event | None = None) -> list[list[int]]:
    """The bystander prompts through (B, D), streamed; their output ids."""

    async def one(i: int) -> list[int]:
        b = t.body(BYSTANDERS[i], t.b, t.b_bootstrap, first + i, stream=True,
                   new_tokens=NEW_TOKENS)
        p = asyncio.ensure_future(http.post(f"{t.b.url}/generate", json={**b, "stream": False}))
        ids: list[int] = []
        async with http.stream("POST", f"{t.d.url}/generate", json=b) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[len("data: "):])
                    assert "error" not in event, event
                    ids += event["output_ids"]
                    if started is not None:
                        started.set()
        assert (await p).status_code == 200
        return ids

    return list(await asyncio.gather(*(one(i) for i in range(len(BYSTANDERS)))))


def rooms_waiting(url: str) -> float:
    return metric(url, 'baton_disagg_rooms{state="waiting_for_input"}')


def events(url: str, kind: str) -> float:
    return metric(url, f'baton_kv_plane_events_total{{kind="{kind}"}}')


@pytest.mark.parametrize("mode", ["partition", "group", "scheduler"])
def test_late_writes_of_a_prefill_declared_gone_land_nowhere(trio: Trio, mode: str) -> None:
    t, room = trio, int(time.time() * 1000) << 8
    partition = Partition(("127.0.0.1", t.a_bootstrap))
    a_port = partition.port if mode == "partition" else t.a_bootstrap  # A's address as D sees it
    disturb: Callable[[], None] = {
        "partition": partition.cut,
        "group": lambda: os.killpg(t.a.proc.pid, signal.SIGSTOP),
        "scheduler": lambda: os.kill(t.a.scheduler_pid(), signal.SIGSTOP),
    }[mode]
    thaw = partition.heal if mode == "partition" else (
        lambda: os.killpg(t.a.proc.pid, signal.SIGCONT))
    before = {k: events(t.d.url, k) for k in ("refused_write", "late_write_contained")}

    async def run() -> tuple[list[list[int]], list[list[int]], list[Any], list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=120) as http:
            undisturbed = await bystanders(http, t, room)
            victims = [t.body(VICTIM, t.a, a_port, room + 100 + i) for i in range(4)]
            on_d = [asyncio.ensure_future(http.post(f"{t.d.url}/generate", json=v))
                    for v in victims]
            await until(lambda: rooms_waiting(t.d.url) == 4, "D's rooms registered with A")
            disturb()
            on_a: list[asyncio.Future[httpx.Response]] = []
            if mode != "partition":  # A takes them when it wakes up
                on_a = [asyncio.ensure_future(http.post(f"{t.a.url}/generate", json=v))
                        for v in victims]
            victims_on_d = list(await asyncio.gather(*on_d))  # D gives up on A
            started = asyncio.Event()
            disturbed = asyncio.ensure_future(bystanders(http, t, room + 200, started))
            with contextlib.suppress(TimeoutError):  # (nixl: they may wait for A's pages)
                await asyncio.wait_for(started.wait(), 2.0)
            if mode == "partition":  # A, alive all along, prefills and writes into D now
                on_a = [asyncio.ensure_future(http.post(f"{t.a.url}/generate", json=v))
                        for v in victims]
                await asyncio.gather(*on_a)
            thaw()
            return undisturbed, await disturbed, victims_on_d, list(await asyncio.gather(*on_a))

    try:
        undisturbed, disturbed, victims_on_d, victims_on_a = asyncio.run(run())
    finally:
        thaw()
        partition.close()
    for r in victims_on_d:
        assert r.status_code == 502, r.text
        assert "stopped answering" in r.json()["error"]["message"]
    assert disturbed == undisturbed, "a bystander's output changed: KV it did not own was written"
    assert all(r.status_code in (200, 502) for r in victims_on_a), [r.text for r in victims_on_a]
    eventually(lambda: all(kv_free(s.url) for s in t.servers()), timeout=30)
    assert metric(t.d.url, "baton_kv_quarantined_pages") == 0
    late = {k: events(t.d.url, k) - before[k] for k in before}
    print(f"{mode}: A answered {[r.status_code for r in victims_on_a]}; D: {late}")
    if mode == "partition":  # the late write was made: D refused it, or kept it in quarantine
        assert late["refused_write" if t.backend == "tcp" else "late_write_contained"] >= 1, late


async def until(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not reached in time: {what}"
        await asyncio.sleep(0.05)
