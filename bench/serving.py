"""Serving latency and throughput of `baton serve` over HTTP (loopback).

    python bench/serving.py [--concurrency 1 8 32] [--max-tokens 32] [--url http://...]

Starts `baton serve` itself (unless --url), then for each concurrency level runs a bounded
number of streaming /generate requests (greedy, ignore_eos, so every request generates exactly
--max-tokens tokens) from that many concurrent clients. Per level: TTFT p50/p99 (request sent ->
first token), inter-token latency p50/p99 (gap between streamed chunks, spread over the tokens
each chunk carries), and output throughput (generated tokens / wall time of the level).
Writes bench/results/serving.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a bicycle stays upright.",
    "List some facts about the Moon:",
    "def quicksort(arr):",
    "The history of the printing press begins",
    "Describe the water cycle in simple terms.",
    "Give three tips for learning a new language:",
    "Once upon a time in a small village,",
]


@dataclass
class RequestResult:
    ttft: float
    itls: list[float]
    tokens: int


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    throughput_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> RequestResult:
    body = {"text": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
    sent = time.perf_counter()
    last, ttft, itls, tokens = sent, 0.0, [], 0
    async with client.stream("POST", "/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            n = len(json.loads(line[6:])["output_ids"])
            now = time.perf_counter()
            if n and tokens == 0:
                ttft = now - sent
                itls += [(now - last) / (n - 1)] * (n - 1) if n > 1 else []
            elif n:
                itls += [(now - last) / n] * n
            tokens += n
            last = now if n else last
    return RequestResult(ttft, itls, tokens)


async def run_level(url: str, concurrency: int, requests: int, max_tokens: int) -> LevelResult:
    queue = list(range(requests))
    results: list[RequestResult] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop()
            results.append(await one_request(client, PROMPTS[i % len(PROMPTS)], max_tokens))

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        began = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - began
    tokens = sum(r.tokens for r in results)
    ttfts = [r.ttft for r in results]
    itls = [x for r in results for x in r.itls]
    return LevelResult(
        concurrency, requests, tokens, round(wall, 2), round(tokens / wall, 1),
        round(pct(ttfts, 50) * 1e3, 1), round(pct(ttfts, 99) * 1e3, 1),
        round(pct(itls, 50) * 1e3, 1), round(pct(itls, 99) * 1e3, 1),
    )


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    baton = Path(sys.executable).parent / "baton"
    cmd = [str(baton), "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"baton serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("baton serve was not ready in 300 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, nargs="+", default=None,
                    help="requests per level (default: max(8, 2 x concurrency))")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--url", default=None, help="benchmark a running server instead")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `baton serve` flag")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serving.json"))
    args = ap.parse_args()
    counts = args.requests or [max(8, 2 * c) for c in args.concurrency]
    proc, url = (None, args.url) if args.url else start_server(args.model, args.server_arg)
    try:
        asyncio.run(run_level(url, 1, 2, 4))  # warm-up
        levels = [asyncio.run(run_level(url, c, n, args.max_tokens))
                  for c, n in zip(args.concurrency, counts, strict=True)]
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    report = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
              "max_tokens": args.max_tokens, "levels": [asdict(lv) for lv in levels]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'conc':>4} {'reqs':>5} {'tok/s':>7} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8}  (ms)")
    for lv in levels:
        print(f"{lv.concurrency:>4} {lv.requests:>5} {lv.throughput_tok_s:>7} {lv.ttft_p50_ms:>9} "
              f"{lv.ttft_p99_ms:>8} {lv.itl_p50_ms:>8} {lv.itl_p99_ms:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
