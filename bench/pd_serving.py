"""bench/pd.py's serving half: colocated `baton serve` vs `baton up` (router + 1P + 1D).

Both run the builtin model with torch's default thread count per server, on this one host, up
at the same time; each concurrency level runs on one then the other (same streaming workload,
bench/serving.py). PD's KV transfer time is the prefill's own measurement
(baton_kv_transfer_seconds on its /metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from serving import LevelResult, run_level, start_server

ROOT = Path(__file__).resolve().parents[1]


def start_up(args: argparse.Namespace, log_dir: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    """`baton up` on a free port; returns (process, router URL, prefill-0 URL) once up."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = log_dir / "up.out"
    cmd = [sys.executable, "-m", "runtime.cli", "up", "--model", args.model, "--port", str(port),
           "--kv-transfer", args.kv_transfer, "--log-dir", str(log_dir)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while "baton is up" not in out.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"baton up failed:\n{out.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    prefill = re.search(r"prefill-0 ready at (\S+)", out.read_text()).group(1)  # type: ignore[union-attr]
    return proc, f"http://127.0.0.1:{port}", prefill


def transfer_seconds(prefill_url: str) -> tuple[float, int]:
    """Mean KV write time per room and the number of rooms, from the prefill's metrics."""
    text = httpx.get(f"{prefill_url}/metrics", timeout=10).text
    total = float(re.search(r"^baton_kv_transfer_seconds_sum (\S+)", text, re.M).group(1))  # type: ignore[union-attr]
    count = float(re.search(r"^baton_kv_transfer_seconds_count (\S+)", text, re.M).group(1))  # type: ignore[union-attr]
    return (total / count if count else float("nan")), int(count)


def interleaved(urls: list[str], args: argparse.Namespace) -> list[list[LevelResult]]:
    """Each concurrency level on every deployment in turn (A, B, A, B ...), so a host that
    speeds up or slows down during the run weighs on both alike. Returns one list per URL."""
    for url in urls:
        asyncio.run(run_level(url, 1, 2, 4))  # warm-up
    out: list[list[LevelResult]] = [[] for _ in urls]
    for c in args.concurrency:
        for i, url in enumerate(urls):
            out[i].append(asyncio.run(run_level(url, c, max(8, 2 * c), args.max_tokens)))
    return out


def run_serving(args: argparse.Namespace) -> dict[str, Any]:
    proc, url = start_server(args.model, [])
    log_dir = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    up, router, prefill = start_up(args, log_dir)
    try:
        colocated, pd = interleaved([url, router], args)
        mean_transfer, rooms = transfer_seconds(prefill)
    except BaseException:
        print(f"PD serving failed; baton up's logs are kept in {log_dir}", file=sys.stderr)
        raise
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    finally:
        for p in (proc, up):
            p.send_signal(signal.SIGTERM)
        proc.wait(60)
        up.wait(120)
    rows = [{"concurrency": c.concurrency, "colocated": asdict(c), "pd": asdict(p),
             "ttft_p50_ratio": p.ttft_p50_ms / c.ttft_p50_ms,
             "throughput_ratio": p.throughput_tok_s / c.throughput_tok_s}
            for c, p in zip(colocated, pd, strict=True)]
    print_table(rows, mean_transfer, rooms)
    first = rows[0]
    target = first["colocated"]["ttft_p50_ms"] * 1.1 + mean_transfer * 1e3
    print(f"target at concurrency {first['concurrency']}: PD TTFT p50 {first['pd']['ttft_p50_ms']:.1f} ms "
          f"<= colocated x 1.1 + transfer = {target:.1f} ms: "
          f"{'met' if first['pd']['ttft_p50_ms'] <= target else 'NOT met'}")
    return {"kv_transfer": args.kv_transfer, "max_tokens": args.max_tokens,
            "mean_transfer_ms": mean_transfer * 1e3, "rooms": rooms, "levels": rows,
            "ttft_target_ms": target, "ttft_target_met": first["pd"]["ttft_p50_ms"] <= target}


def print_table(rows: list[dict[str, Any]], mean_transfer: float, rooms: int) -> None:
    print(f"\nServing, {rows[0]['colocated']['requests']}+ requests per level; PD's mean KV "
          f"transfer {mean_transfer * 1e3:.2f} ms over {rooms} rooms")
    print(f"{'conc':>4} | {'colocated TTFT p50/p99':>22} {'ITL p50':>8} {'tok/s':>7} | "
          f"{'PD TTFT p50/p99':>16} {'ITL p50':>8} {'tok/s':>7} | {'TTFT x':>7} {'tok/s x':>8}")
    for r in rows:
        c, p = r["colocated"], r["pd"]
        print(f"{r['concurrency']:>4} | {c['ttft_p50_ms']:>10.1f} / {c['ttft_p99_ms']:>9.1f} "
              f"{c['itl_p50_ms']:>8.1f} {c['throughput_tok_s']:>7.1f} | {p['ttft_p50_ms']:>7.1f} / "
              f"{p['ttft_p99_ms']:>6.1f} {p['itl_p50_ms']:>8.1f} {p['throughput_tok_s']:>7.1f} | "
              f"{r['ttft_p50_ratio']:>7.2f} {r['throughput_ratio']:>8.2f}")
