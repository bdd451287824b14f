"""Prefill/decode disaggregation: KV transfer bandwidth, and PD serving against colocated.

    python bench/pd.py [--tokens 256 1024 4096] [--concurrency 1 16 64] [--skip-serving]
                       [--kv-cache-dtype float32 bfloat16 fp8_e4m3]

1. Transfer: two processes on loopback, each with a KV pool of the builtin model's layout
   (30 layers, 3 KV heads x 64, pages of 16 tokens) in each --kv-cache-dtype asked for
   (float32 by default; fp8_e4m3 is --kv-cache-dtype fp8_e4m3's pool: one byte an element,
   scales 1.0), then a table of bytes and time per token for each dtype side by side. The sender writes one prompt's
   pages (K and V of every layer, scattered pages) into the receiver's pool through baton's own
   KVTransfer backends (nixl, tcp), with the aux record behind them, and times until the
   receiver process reports the room arrived. Peers in the same run: a single-thread memcpy
   and one process_vm_writev of the same bytes between pool-sized buffers.
2. Serving: `baton serve` (colocated) and `baton up` (router + 1 prefill + 1 decode) on the
   builtin model, the same streaming workload at each concurrency (bench/serving.py): TTFT
   p50/p99, ITL, throughput, side by side with ratios; PD's mean KV transfer time is read from
   the prefill's /metrics.
Writes bench/results/pd.json and prints tables.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import socket
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUT = {"num_layers": 30, "page_size": 16, "num_kv_heads": 3, "head_dim": 64}
POOL_TOKENS = 8192


KV_DTYPES = ("float32", "bfloat16", "fp8_e4m3")


def make_pool(kv_dtype: str) -> Any:
    """A pool of the layout in `kv_dtype` (fp8_e4m3: float8 pages of a float32 model), its
    bytes random (a transfer moves bytes, whatever they mean)."""
    import torch

    from runtime.kvcache.fp8 import KVScales
    from runtime.kvcache.pool import KVPool

    fp8 = kv_dtype == "fp8_e4m3"
    pool = KVPool(LAYOUT["num_layers"], POOL_TOKENS // LAYOUT["page_size"], LAYOUT["page_size"],
                  LAYOUT["num_kv_heads"], LAYOUT["head_dim"],
                  torch.float32 if fp8 else getattr(torch, kv_dtype),
                  scales=KVScales.default(LAYOUT["num_layers"]) if fp8 else None)
    pool.page_rows().random_()
    return pool


def receiver_main(backend: str, kv_dtype: str, secret: bytes, conn: Connection) -> None:
    """The decode side: pool, transfer, receiver; for each room the sender announces (its
    destination pages), reports over `conn` once its KV and aux record arrived."""
    import threading

    from runtime.auth.key import ClusterKey
    from runtime.disagg.fence import WriteFence
    from runtime.disagg.receiver import KVReceiver
    from runtime.disagg.tally import Tally
    from runtime.disagg.transfer.base import create_transfer

    pool = make_pool(kv_dtype)
    arrival = threading.Event()
    fence = WriteFence(arrival.set)
    transfer = create_transfer(backend, pool, "bench-decode", fence)
    receiver = KVReceiver("127.0.0.1", 0, transfer, ClusterKey(secret), "bench-decode",
                          lambda: None, Tally())
    receiver.start()
    conn.send((transfer.local_info(), receiver.port))
    while True:
        room, dst = conn.recv()
        fence.expect(room, dst, "bench-prefill")
        conn.send("expecting")
        while fence.arrived(room) is None:
            arrival.wait()
            arrival.clear()
        fence.discard(room)
        conn.send(room)


def page_lists(rng: random.Random, num_pages: int, pages: int, layout: str) -> tuple[list[int], list[int]]:
    """Source and destination pages: one run each (a fresh pool) or scattered (after churn)."""
    if layout == "contiguous":
        src_at, dst_at = rng.randrange(num_pages - pages + 1), rng.randrange(num_pages - pages + 1)
        return list(range(src_at, src_at + pages)), list(range(dst_at, dst_at + pages))
    return rng.sample(range(num_pages), pages), rng.sample(range(num_pages), pages)


def transfer_bench(backend: str, tokens: list[int], reps: int, kv_dtype: str = "float32",
                   secret: bytes = b"") -> list[dict[str, Any]]:
    from runtime.auth.key import ClusterKey
    from runtime.disagg.handshake import open_link
    from runtime.disagg.transfer.base import create_transfer
    from runtime.disagg.wire import AuxRecord

    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=receiver_main, args=(backend, kv_dtype, secret, child),
                                           daemon=True)
    proc.start()
    try:
        info, port = parent.recv()
        pool = make_pool(kv_dtype)
        transfer = create_transfer(backend, pool, "bench-prefill")
        transfer.connect("decode", info)
        link = socket.create_connection(("127.0.0.1", port))
        link.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        open_link(link, ClusterKey(secret), "bench-prefill", "bench-decode")
        rows, rng, room = [], random.Random(0), 0

        def one(src: list[int], dst: list[int], n: int) -> tuple[int, float]:
            parent.send((room, dst))
            assert parent.recv() == "expecting"
            began = time.perf_counter()
            nbytes = transfer.write("decode", link, src, dst, AuxRecord(room, "b", n, 0))
            assert parent.recv() == room
            return nbytes, time.perf_counter() - began

        for _ in range(3):  # warm-up, not measured: the first WRITEs set up UCX's lanes
            room += 1
            one(*page_lists(rng, pool.num_pages, tokens[0] // LAYOUT["page_size"], "scattered"),
                tokens[0])
        for layout in ("contiguous", "scattered"):
            for n in tokens:
                pages = n // LAYOUT["page_size"]
                times = []
                for _ in range(reps):
                    room += 1
                    nbytes, seconds = one(*page_lists(rng, pool.num_pages, pages, layout), n)
                    times.append(seconds)
                t = statistics.median(times)
                rows.append({"backend": backend, "kv_dtype": kv_dtype, "pages": layout,
                             "tokens": n, "bytes": nbytes, "bytes_per_token": nbytes / n,
                             "median_s": t, "gb_s": nbytes / t / 1e9})
        transfer.close()
        link.close()
        return rows
    finally:
        proc.kill()
        proc.join(5)


def pool_bytes() -> int:
    return POOL_TOKENS * LAYOUT["num_layers"] * 2 * LAYOUT["num_kv_heads"] * LAYOUT["head_dim"] * 4


def spots(rng: random.Random, nbytes: int, reps: int) -> list[tuple[int, int]]:
    """(source, destination) byte offsets of `nbytes` in two pool-sized buffers, fresh for each
    rep as a transfer's pages are (so no peer copies cache-resident bytes: L3 holds 11.8 MB)."""
    top = pool_bytes() - nbytes
    return [(rng.randrange(top + 1) & ~4095, rng.randrange(top + 1) & ~4095) for _ in range(reps)]


def cma_child(conn: Connection) -> None:
    """Owns the destination buffer; the parent writes into it with process_vm_writev."""
    import torch

    from runtime.kvcache.pool import huge_page_zeros

    dst = huge_page_zeros((pool_bytes(),), torch.uint8)
    conn.send((os.getpid(), dst.data_ptr()))
    conn.recv()


def cma_bench(nbytes: int, reps: int) -> float:
    """The cma transport's own ceiling: one process_vm_writev of `nbytes` into another process
    (what UCX uses for host memory on one machine), single thread, pool-like buffers."""
    import ctypes

    import torch

    from runtime.kvcache.pool import huge_page_zeros

    class Iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    libc = ctypes.CDLL(None, use_errno=True)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=cma_child, args=(child,))
    proc.start()
    pid, addr = parent.recv()
    src = huge_page_zeros((pool_bytes(),), torch.uint8).random_()
    times = []
    for src_at, dst_at in spots(random.Random(1), nbytes, reps):
        local, remote = Iovec(src.data_ptr() + src_at, nbytes), Iovec(addr + dst_at, nbytes)
        began = time.perf_counter()
        done = libc.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        times.append(time.perf_counter() - began)
        assert done == nbytes, f"process_vm_writev: errno {ctypes.get_errno()}"
    parent.send("done")
    proc.join(10)
    return nbytes / statistics.median(times) / 1e9


def memcpy_bench(nbytes: int, reps: int) -> float:
    """Single-thread memcpy GB/s of `nbytes` between two pool-sized buffers allocated as the KV
    pool is (transparent huge pages), at fresh offsets each rep."""
    import torch

    from runtime.kvcache.pool import huge_page_zeros

    torch.set_num_threads(1)
    src = huge_page_zeros((pool_bytes(),), torch.uint8).random_()
    dst = huge_page_zeros((pool_bytes(),), torch.uint8)
    times = []
    for src_at, dst_at in spots(random.Random(2), nbytes, reps):
        began = time.perf_counter()
        dst[dst_at : dst_at + nbytes].copy_(src[src_at : src_at + nbytes])
        times.append(time.perf_counter() - began)
    return nbytes / statistics.median(times) / 1e9


def run_transfers(tokens: list[int], reps: int, kv_dtypes: list[str]) -> dict[str, Any]:
    rows = []
    for backend in ("nixl", "tcp"):
        for kv_dtype in kv_dtypes:
            try:
                rows += transfer_bench(backend, tokens, reps, kv_dtype)
            except Exception as e:  # e.g. nixl missing on this host: say so, measure the rest
                print(f"{backend}: not measured ({e})", file=sys.stderr)
    sizes = sorted({r["bytes"] for r in rows})
    memcpy = {n: memcpy_bench(n, reps) for n in sizes}
    cma = {n: cma_bench(n, reps) for n in sizes}
    for r in rows:
        r["memcpy_gb_s"], r["cma_gb_s"] = memcpy[r["bytes"]], cma[r["bytes"]]
        r["vs_memcpy"] = r["gb_s"] / r["memcpy_gb_s"]
    print(f"\nKV transfer, {LAYOUT}, median of {reps}; peers: single-thread memcpy and "
          "one process_vm_writev (cma) of the same bytes")
    print(f"{'backend':>8} {'kv dtype':>9} {'pages':>11} {'tokens':>7} {'MB':>7} {'ms':>8} "
          f"{'GB/s':>6} {'memcpy':>7} {'cma':>6} {'/memcpy':>8}")
    for r in rows:
        print(f"{r['backend']:>8} {r['kv_dtype']:>9} {r['pages']:>11} {r['tokens']:>7} "
              f"{r['bytes'] / 1e6:>7.1f} {r['median_s'] * 1e3:>8.2f} {r['gb_s']:>6.2f} "
              f"{r['memcpy_gb_s']:>7.2f} {r['cma_gb_s']:>6.2f} {r['vs_memcpy']:>8.2f}")
    per_token = dtype_table(rows, kv_dtypes)
    return {"rows": rows, "memcpy_gb_s": memcpy, "cma_gb_s": cma, "per_token": per_token}


def dtype_table(rows: list[dict[str, Any]], kv_dtypes: list[str]) -> list[dict[str, Any]]:
    """Bytes and microseconds per token of each dtype side by side (scattered pages), each as a
    fraction of the first dtype's; printed, and returned for the report."""
    out = []
    print(f"\nPer token, scattered pages: {' | '.join(kv_dtypes)} (x: of {kv_dtypes[0]}'s)")
    for backend in sorted({r["backend"] for r in rows}):
        for n in sorted({r["tokens"] for r in rows}):
            cells = {r["kv_dtype"]: r for r in rows if r["backend"] == backend
                     and r["tokens"] == n and r["pages"] == "scattered"}
            if kv_dtypes[0] not in cells:
                continue
            base = cells[kv_dtypes[0]]
            line = []
            for d in kv_dtypes:
                r = cells.get(d)
                if r is None:
                    continue
                us = r["median_s"] / n * 1e6
                row = {"backend": backend, "tokens": n, "kv_dtype": d,
                       "bytes_per_token": r["bytes_per_token"], "us_per_token": us,
                       "bytes_x": r["bytes"] / base["bytes"], "time_x": r["median_s"] / base["median_s"]}
                out.append(row)
                line.append(f"{d} {r['bytes_per_token']:.0f} B {us:.2f} us "
                            f"({row['bytes_x']:.2f}x B, {row['time_x']:.2f}x t)")
            print(f"{backend:>6} {n:>6} tokens: " + " | ".join(line))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--kv-transfer", default="nixl", choices=["nixl", "tcp"])
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["float32"], choices=KV_DTYPES,
                    help="the transfer's pool dtypes, measured side by side (the serving part "
                         "runs the servers' default)")
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pd.json"))
    args = ap.parse_args()
    report: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    report["transfer"] = run_transfers(args.tokens, args.reps, args.kv_cache_dtype)
    if not args.skip_serving:
        from pd_serving import run_serving

        report["serving"] = run_serving(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
