"""What the cluster key costs a PD deployment: the same run with the key on and off, side by side.

    python bench/pd_key.py [--model builtin:smollm2-135m] [--kv-transfer nixl] [--requests 40]

1. Transfer: bench/pd.py's KV transfer (a KVTransfer writing one prompt's pages into another
   process's pool and the receiver reporting the room) over a link opened without a key and
   over one that proved a key, alternating: GB/s for each and the ratio (the key is checked once
   per link, at its handshake, so this should be noise).
2. Serving, concurrency 1: two `baton up`-shaped deployments (router + 1 prefill + 1 decode, the
   same processes `baton up` starts), one with a cluster key and one without, up at the same
   time; streaming requests alternate between them (A B B A ...). TTFT p50 of each, their ratio,
   and the median of the paired differences with a bootstrap 95% interval (requests on this
   host vary by several ms): the key adds a ticket signed by the router and checked by both
   workers, a signed bootstrap call per room and a handshake per link.
3. The per-request CPU work the key adds, timed in this process: sign + check a room ticket,
   sign + check a bootstrap call.
Targets (issue: KV plane integrity): TTFT at most 2 ms and 5% worse, transfer at most 5% worse.
Writes bench/results/pd_key.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from pd import transfer_bench  # noqa: E402
from serving import run_level  # noqa: E402


def transfers(tokens: list[int], reps: int, rounds: int) -> list[dict[str, Any]]:
    """Off and on alternate `rounds` times (a host that drifts weighs on both alike); each
    side's GB/s is the best of its rounds' medians."""
    rows = []
    for backend in ("tcp", "nixl"):
        runs: dict[str, list[list[dict[str, Any]]]] = {"off": [], "on": []}
        try:
            for i in range(rounds):  # off, on, on, off, off, on ...: neither always goes first
                for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
                    secret = secrets.token_hex(32).encode() if side == "on" else b""
                    runs[side].append(transfer_bench(backend, tokens, reps, secret=secret))
        except Exception as e:  # nixl missing on this host: say so, measure the rest
            print(f"{backend}: not measured ({e})", file=sys.stderr)
            continue
        for i, first in enumerate(runs["off"][0]):
            off = max(r[i]["gb_s"] for r in runs["off"])
            on = max(r[i]["gb_s"] for r in runs["on"])
            rows.append({"backend": backend, "pages": first["pages"], "tokens": first["tokens"],
                         "off_gb_s": off, "on_gb_s": on, "ratio": on / off})
    print(f"\nKV transfer GB/s, key off vs on (best of {rounds} alternating rounds, each the "
          f"median of {reps})")
    print(f"{'backend':>8} {'pages':>11} {'tokens':>7} {'off':>7} {'on':>7} {'on/off':>7}")
    for r in rows:
        print(f"{r['backend']:>8} {r['pages']:>11} {r['tokens']:>7} {r['off_gb_s']:>7.2f} "
              f"{r['on_gb_s']:>7.2f} {r['ratio']:>7.2f}")
    return rows


def deployments(args: argparse.Namespace, log_dir: Path) -> list[Any]:
    """Two router + 1P + 1D deployments (as `baton up` plans them), keyed and not, ready."""
    from runtime.launch import Deployment, free_port, plan

    out = []
    for name, key in (("off", None), ("on", secrets.token_hex(32))):
        ns = argparse.Namespace(model=args.model, prefill=1, decode=1, host="127.0.0.1",
                                port=free_port("127.0.0.1"), kv_transfer=args.kv_transfer,
                                policy="round_robin")
        (log_dir / name).mkdir()
        d = Deployment(plan(ns, [], log_dir / name))
        d.start(key)
        out.append(d)
    for d in out:
        d.wait_ready()
    return out


async def ttfts(urls: list[str], requests: int, max_tokens: int) -> list[list[float]]:
    """Concurrency 1, one request at a time alternating between the deployments (A B B A ...:
    neither always goes first); TTFTs in ms, paired by index."""
    for url in urls:
        await run_level(url, 1, 4, 4)  # warm-up
    out: list[list[float]] = [[] for _ in urls]
    for n in range(requests):
        for i in (0, 1) if n % 2 == 0 else (1, 0):
            level = await run_level(urls[i], 1, 1, max_tokens)
            out[i].append(level.ttft_p50_ms)
    return out


def paired(off: list[float], on: list[float], draws: int = 2000) -> tuple[float, float, float]:
    """Median of the paired differences on - off, and a bootstrap 95% interval of it."""
    import random

    diffs = [b - a for a, b in zip(off, on, strict=True)]
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(draws))
    return statistics.median(diffs), medians[int(0.025 * draws)], medians[int(0.975 * draws)]


def serving(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="bench-pd-key-"))
    running = deployments(args, log_dir)
    try:
        urls = [d.children[-1].url for d in running]
        off, on = asyncio.run(ttfts(urls, args.requests, args.max_tokens))
    finally:
        for d in running:
            d.stop()
    p50_off, p50_on = statistics.median(off), statistics.median(on)
    diff, low, high = paired(off, on)
    row = {"requests": args.requests, "ttft_p50_off_ms": p50_off, "ttft_p50_on_ms": p50_on,
           "diff_ms": diff, "diff_ci95_ms": [low, high], "ratio": p50_on / p50_off,
           "spread_off_ms": [min(off), max(off)], "spread_on_ms": [min(on), max(on)]}
    print(f"\nServing at concurrency 1, {args.requests} requests each, alternating "
          f"({args.kv_transfer}); TTFT p50 key off {p50_off:.1f} ms, on {p50_on:.1f} ms "
          f"(x{row['ratio']:.3f}); paired difference on - off: median {diff:+.2f} ms, 95% "
          f"interval [{low:+.2f}, {high:+.2f}] ms")
    return row


def cpu_costs(n: int = 2000) -> dict[str, float]:
    from runtime.auth.key import ClusterKey
    from runtime.auth.signed import HEADER, CallGate, sign_call
    from runtime.auth.ticket import TicketGate, sign

    key = ClusterKey(secrets.token_hex(32).encode())
    gate, calls = TicketGate(key, "decode"), CallGate(key)
    began = time.perf_counter()
    for i in range(n):
        token = sign(key, i, f"rid{i}", "P", "10.0.0.1", 8998, "D")
        gate.admit(token, [i], f"rid{i}", "10.0.0.1", 8998, "D")
    ticket_us = (time.perf_counter() - began) / n * 1e6
    body = json.dumps({"room": 1, "dst_pages": list(range(64))}).encode()
    began = time.perf_counter()
    for _ in range(n):
        header = sign_call(key, "POST", "/rooms", body)[HEADER]
        assert calls.problem(header, "POST", "/rooms", body) is None
    call_us = (time.perf_counter() - began) / n * 1e6
    print(f"\nCPU per request: sign + check a room ticket {ticket_us:.1f} us; sign + check a "
          f"bootstrap call {call_us:.1f} us")
    return {"ticket_us": ticket_us, "bootstrap_call_us": call_us}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--kv-transfer", default="nixl", choices=["nixl", "tcp"])
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pd_key.json"))
    args = ap.parse_args()
    report = {"cpu": cpu_costs(), "transfer": transfers(args.tokens, args.reps, args.rounds),
              "serving": serving(args)}
    s = report["serving"]
    worst = min(r["ratio"] for r in report["transfer"]) if report["transfer"] else float("nan")
    met = s["diff_ms"] <= 2.0 and s["ratio"] <= 1.05 and worst >= 0.95
    print(f"\ntargets (TTFT <= +2 ms and x1.05, transfer >= x0.95): {'met' if met else 'NOT met'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
