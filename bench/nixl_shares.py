"""One room's nixl WRITE under tensor parallelism, by (prefill tp, decode tp), for the builtin
model's KV shape (30 layers, 3 KV heads, head_dim 64, 16-token pages, float32 on the CPU):
every rank's agent in this one process, over UCX on loopback (docs/tensor-parallel.md "PD with
TP" quotes the result).

    python bench/nixl_shares.py [--tokens 512] [--repeats 7]

A room is written as its shares (runtime/disagg/shares.py): P1 -> D1 and P3 -> D3 as runs of
pages (one descriptor per run), P1 -> D3 and P3 -> D1 as head rows (2 x 30 x 16 = 960
descriptors a page on each side). Each share is timed on its own (median of the repeats, the
descriptors built inside it); a room's time is the slowest prefill rank's shares in a row (the
ranks of a server write at once, each its own shares one after another). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import uuid
from dataclasses import asdict

import numpy as np
import torch

from runtime.disagg.fence import WriteFence
from runtime.disagg.shares import Share, Split, head_rows, plan
from runtime.disagg.transfer.nixl import NixlTransfer
from runtime.disagg.wire import KVLayout, PeerRegistration
from runtime.kvcache.pool import KVPool

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 30, 3, 64, 16


def server(role: str, tp: int, num_pages: int) -> list[NixlTransfer]:
    layout = KVLayout(LAYERS, PAGE, KV_HEADS, HEAD_DIM, "float32", tp_size=tp)
    name = f"baton-{role}-{uuid.uuid4().hex[:8]}"
    ranks = []
    for r in range(tp):
        pool = KVPool(LAYERS, num_pages, PAGE, KV_HEADS // tp, HEAD_DIM, torch.float32)
        pool.buffer.normal_()
        ranks.append(NixlTransfer(pool, name, WriteFence(rank=r), layout, r))
    return ranks


def registration(decode: list[NixlTransfer]) -> PeerRegistration:
    return PeerRegistration("decode", "127.0.0.1", 1, asdict(decode[0].layout), "nixl",
                            decode[0].local_info(), [["127.0.0.1", 2 + r] for r in
                                                     range(1, len(decode))],
                            [t.local_info() for t in decode[1:]])


def time_share(prefill: list[NixlTransfer], peer: PeerRegistration, share: Share,
               pages: list[int], repeats: int) -> float:
    prefill[share.src].write_share(peer, None, 1, pages, pages, share)  # connect, warm up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        prefill[share.src].write_share(peer, None, 1, pages, pages, share)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def pages_of(n: int) -> list[int]:
    return list(range(n))


def run(p_tp: int, d_tp: int, tokens: int, repeats: int) -> dict[str, object]:
    n = -(-tokens // PAGE)
    prefill, decode = server("prefill", p_tp, n + 8), server("decode", d_tp, n + 8)
    try:
        peer = registration(decode)
        for t in decode:  # their progress threads poll while a room is expected, as in serving
            t.fence.expect(1, pages_of(n), prefill[0].agent_name)
        shares = plan(Split(p_tp, KV_HEADS), Split(d_tp, KV_HEADS))
        pages = pages_of(n)
        per_share = {f"{s.src}->{s.dst} heads [{s.lo},{s.hi})":
                     round(time_share(prefill, peer, s, pages, repeats) * 1e3, 2) for s in shares}
        by_rank: dict[int, float] = {}
        for s, ms in zip(shares, per_share.values(), strict=True):
            by_rank[s.src] = by_rank.get(s.src, 0.0) + ms
        return {"prefill_tp": p_tp, "decode_tp": d_tp, "pages": n, "share_ms": per_share,
                "room_ms": round(max(by_rank.values()), 2),
                "mb": round(n * decode[0].layout.page_bytes / 2**20, 1)}
    finally:
        for t in (*prefill, *decode):
            t.close()


def descriptors_ms(tokens: int) -> float:
    """Building one split share's rows for both sides (numpy), alone."""
    layout = KVLayout(LAYERS, PAGE, KV_HEADS, HEAD_DIM, "float32", tp_size=3)
    pages = np.arange(-(-tokens // PAGE))
    began = time.perf_counter()
    for _ in range(20):
        head_rows(pages, (0, 3), Share(0, 1, 1, 2), layout)
        head_rows(pages, (1, 2), Share(0, 1, 1, 2), layout)
    return (time.perf_counter() - began) / 20 * 1e3


def main() -> None:
    logging.disable(logging.WARNING)  # the fences here are told no shares: they refuse them
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    out = [run(p, d, args.tokens, args.repeats) for p, d in ((1, 1), (3, 3), (1, 3), (3, 1))]
    print(json.dumps({"tokens": args.tokens, "results": out,
                      "head_rows_both_sides_ms": round(descriptors_ms(args.tokens), 2)}, indent=1))


if __name__ == "__main__":
    main()
