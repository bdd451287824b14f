"""A chaos soak of a PD deployment: real processes (2 prefills, 2 decodes, a router; tiny random
Llama, tcp, a cluster key) under `concurrency` clients while a random worker is killed with -9
and started again on its ports every `interval` seconds (the next kill waits until every worker
is ready again). Every answer must be a 200 whose greedy output equals the undisturbed one;
at the end every worker's KV is free.

    python -m tests.disagg.chaos --duration 600 --interval 20     # the long soak, by hand

tests/disagg/test_pd_chaos.py runs a bounded one in the suite and the long one as `slow`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from runtime.auth.key import ENV
from tests.disagg.test_pd_failures import FAST, kv_free
from tests.ports import free_ports
from tests.router.router_process import RouterProcess, start_router
from tests.server.server_process import ServerProcess

WORDS = ["red", "green", "blue", "cyan", "gold", "gray", "pink", "teal", "navy", "lime"]
PROMPTS = 24
MAX_NEW = 24


@dataclass
class Worker:
    role: str
    args: tuple[str, ...]
    log_dir: Path
    model: str
    env: dict[str, str]
    port: int
    lives: int = 0
    server: ServerProcess | None = None

    def start(self) -> None:
        self.lives += 1
        self.server = ServerProcess(
            "--role", self.role, "--kv-transfer", "tcp", *FAST, *self.args, port=self.port,
            log_path=self.log_dir / f"{self.role}-{self.port}-{self.lives}.log", model=self.model,
            env=self.env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


@dataclass
class Soak:
    workers: list[Worker]
    router: RouterProcess
    answers: int = 0
    problems: list[str] = field(default_factory=list)
    kills: list[str] = field(default_factory=list)

    def stop(self) -> None:
        self.router.stop()
        for w in self.workers:
            if w.server is not None and w.server.proc.poll() is None:
                w.server.stop()


def deploy(model: str, log_dir: Path) -> Soak:
    env = {ENV: secrets.token_hex(32)}
    ports = free_ports(8)  # all at once (HTTP, bootstrap, KV): none can be picked twice
    workers = [Worker("prefill", ("--bootstrap-port", str(ports[i])), log_dir, model, env,
                      port=ports[4 + i]) for i in range(2)]
    workers += [Worker("decode", ("--kv-port", str(ports[2 + i])), log_dir, model, env,
                       port=ports[6 + i]) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        assert w.server is not None
        w.server.wait_ready()
    flags = [a for w in workers if w.role == "prefill"
             for a in ("--prefill", f"{w.url},{w.args[1]}")]
    flags += [a for w in workers if w.role == "decode" for a in ("--decode", w.url)]
    router = start_router(*flags, "--policy", "least_load", log_path=log_dir / "router.log",
                          env=env)
    return Soak(workers, router)


def prompt(i: int) -> str:
    return " ".join(WORDS[(i * 3 + k * k) % len(WORDS)] for k in range(40 + i % 7))


async def ask(http: httpx.AsyncClient, url: str, i: int, stream: bool) -> list[int] | str:
    """Prompt i's greedy output ids, or what went wrong."""
    body = {"text": prompt(i), "stream": stream, "sampling_params": {
        "temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}}
    try:
        if not stream:
            r = await http.post(f"{url}/generate", json=body)
            return r.json()["output_ids"] if r.status_code == 200 else f"{r.status_code} {r.text}"
        ids: list[int] = []
        async with http.stream("POST", f"{url}/generate", json=body) as r:
            if r.status_code != 200:
                return f"{r.status_code} {(await r.aread()).decode()}"
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return f"in-band {event['error']}"
                    ids += event["output_ids"]
        return ids
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"


async def reference(url: str) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=120) as http:
        outs = await asyncio.gather(*(ask(http, url, i, False) for i in range(PROMPTS)))
    assert all(isinstance(o, list) for o in outs), outs
    return [o for o in outs if isinstance(o, list)]


async def clients(soak: Soak, expected: list[list[int]], concurrency: int, until: float) -> None:
    async def one(c: int) -> None:
        n = c
        async with httpx.AsyncClient(timeout=120) as http:
            while time.monotonic() < until:
                i = n % PROMPTS
                got = await ask(http, soak.router.url, i, stream=n % 2 == 0)
                soak.answers += 1
                if got != expected[i]:
                    soak.problems.append(f"prompt {i}: {got if isinstance(got, str) else 'wrong tokens'}")
                n += concurrency

    await asyncio.gather(*(one(c) for c in range(concurrency)))


async def chaos(soak: Soak, interval: float, until: float, rng: random.Random) -> None:
    while time.monotonic() + interval < until:
        await asyncio.sleep(interval)
        deadline = time.monotonic() + 120
        while not all(await asyncio.gather(*(asyncio.to_thread(w.ready) for w in soak.workers))):
            assert time.monotonic() < deadline, "a restarted worker never got ready"
            await asyncio.sleep(0.2)
        victim = rng.choice(soak.workers)
        assert victim.server is not None
        soak.kills.append(f"{victim.role}:{victim.port}")
        await asyncio.to_thread(victim.server.kill)
        # NOTE: started from this (the main) thread: a child's parent-death signal fires when
        # the thread that started it ends, and to_thread's workers end with the loop
        victim.start()


def settled(w: Worker) -> bool:
    try:
        return kv_free(w.url)
    except httpx.HTTPError:
        return False


def run(model: str, log_dir: Path, duration: float, interval: float, concurrency: int = 32,
        seed: int = 0) -> Soak:
    soak = deploy(model, log_dir)
    try:
        expected = asyncio.run(reference(soak.router.url))

        async def both() -> None:
            until = time.monotonic() + duration
            await asyncio.gather(clients(soak, expected, concurrency, until),
                                 chaos(soak, interval, until, random.Random(seed)))

        asyncio.run(both())
        deadline = time.monotonic() + 60
        while not all(w.ready() and settled(w) for w in soak.workers):
            if time.monotonic() > deadline:
                soak.problems.append("not ready with its KV free at the end: " + ", ".join(
                    f"{w.role}:{w.port}" for w in soak.workers if not settled(w)))
                break
            time.sleep(0.2)
    finally:
        soak.stop()
    return soak


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model folder (tests use a tiny random Llama)")
    p.add_argument("--duration", type=float, default=600)
    p.add_argument("--interval", type=float, default=20)
    p.add_argument("--concurrency", type=int, default=32)
    args = p.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="baton-chaos-"))
    soak = run(args.model, log_dir, args.duration, args.interval, args.concurrency)
    print(f"{soak.answers} answers, {len(soak.kills)} kills ({', '.join(soak.kills)}), "
          f"{len(soak.problems)} problems; logs in {log_dir}")
    for problem in soak.problems[:20]:
        print("  ", problem)
    return 1 if soak.problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
