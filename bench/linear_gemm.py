"""fp32 GEMM on SmolLM2-135M's shapes: torch's F.linear (MKL) vs oneDNN (runtime/models/linear.py).

    python bench/linear_gemm.py [--rows 1 8 64 256] [--threads 2]

Times one pass over 30 layers of fresh weights (so they stream from memory, as in a decode step)
and the 49k-vocab lm_head, for each row count, and prints ms and the oneDNN speed-up. Also prints
the largest difference from a float64 reference for both, to show both stay fp32-exact-ish.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from runtime.models.linear import Linear

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
NUM_LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def best_ms(lins: list[Linear], xs: dict[int, torch.Tensor], repeats: int = 5) -> float:
    run(lins, xs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(lins, xs)
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def run(lins: list[Linear], xs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    return [lin(xs[lin.in_features]) for lin in lins]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [[torch.randn(*s) / s[1] ** 0.5 for s in LAYER_SHAPES] for _ in range(NUM_LAYERS)]
    head = torch.randn(VOCAB, HIDDEN) / HIDDEN**0.5
    kinds = {"torch": False, "onednn": True}
    parts = {
        "layers": {k: [Linear(w, None, on) for ws in weights for w in ws] for k, on in kinds.items()},
        "lm_head": {k: [Linear(head, None, on)] for k, on in kinds.items()},
    }
    print(f"{platform.processor() or platform.machine()}, {args.threads} threads, fp32")
    print(f"{'rows':>5} {'part':>8} {'torch ms':>9} {'oneDNN ms':>10} {'speed-up':>9} "
          f"{'torch err':>10} {'oneDNN err':>11}")
    for rows in args.rows:
        xs = {n: torch.randn(rows, n) for n in (HIDDEN, 1536)}
        for part, lins in parts.items():
            ms = {k: best_ms(lins[k], xs) for k in kinds}
            first = head if part == "lm_head" else weights[0][0]
            ref = xs[HIDDEN].double() @ first.double().t()
            err = {k: (run(lins[k][:1], xs)[0].double() - ref).abs().max().item() for k in kinds}
            print(f"{rows:>5} {part:>8} {ms['torch']:>9.2f} {ms['onednn']:>10.2f} "
                  f"{ms['torch'] / ms['onednn']:>8.2f}x {err['torch']:>10.1e} {err['onednn']:>11.1e}")


if __name__ == "__main__":
    main()
