"""Decode speed of the CPU's precision modes against fp32, in one run, on the same prompts.

    python bench/quant_speed.py [--model builtin:smollm2-135m] [--modes none,int8,int4]
                                [--new 128] [--conc 1,8,32] [--repeat 3] [--out DIR]

For each `--quantization` mode, one Engine (the same threads, --quant-max-rows default), greedy,
exactly --new tokens per prompt: single-stream decode tok/s (the best of --repeat runs) and the
throughput of --conc prompts at once, each as a ratio to fp32's (mode `none`). The quality of
each mode is bench/quality.py's gate; this only says how fast it is. No llama-server here: its
single stream is bench/prefix.py's peer (ENVIRONMENT.md says how to build it). Run it on an idle
machine. Writes DIR/quant_speed.json (default DIR: bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from throughput import CORPUS, git_describe  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--modes", default="none,int8,int4")
    p.add_argument("--new", type=int, default=128, help="tokens per prompt (default 128)")
    p.add_argument("--conc", default="1,8,32", help="prompts at once (1: single stream)")
    p.add_argument("--repeat", type=int, default=3, help="runs per cell; the best counts")
    p.add_argument("--out", type=Path, default=HERE / "results")
    return p.parse_args(argv)


def prompts(n: int) -> list[str]:
    """n prompts of 20 words each, different windows of the same text (wrapping around)."""
    words = CORPUS.split()
    return [" ".join(words[(i * 23 + j) % len(words)] for j in range(20)) for i in range(n)]


def measure(mode: str, args: argparse.Namespace) -> dict[str, float]:
    from runtime import Engine

    engine = Engine(model=args.model, max_total_tokens=16384, quantization=mode)
    params = {"temperature": 0, "max_new_tokens": args.new, "ignore_eos": True}
    try:
        engine.generate(prompts(2), {**params, "max_new_tokens": 4})  # warm-up
        row = {}
        for conc in (int(c) for c in args.conc.split(",")):
            best = 0.0
            for _ in range(args.repeat):
                start = time.perf_counter()
                engine.generate(prompts(conc), params)
                best = max(best, conc * args.new / (time.perf_counter() - start))
            row[f"conc{conc}"] = round(best, 1)
            print(f"  {mode:<5} {conc:>3} at once: {best:7.1f} tok/s", flush=True)
        return row
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load0 = os.getloadavg()
    rows = {mode: measure(mode, args) for mode in args.modes.split(",")}
    base = rows.get("none")
    cols = list(next(iter(rows.values())))
    print(f"\n{'mode':<6}" + "".join(f"{c + ' tok/s':>14}{'x fp32':>8}" for c in cols))
    for mode, row in rows.items():
        cells = "".join(f"{row[c]:>14.1f}{(row[c] / base[c] if base else float('nan')):>8.2f}"
                        for c in cols)
        print(f"{mode:<6}{cells}")
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"model": args.model, "new_tokens": args.new, "modes": rows,
                              "load_before": load0, "load_after": os.getloadavg(),
                              "git": git_describe()}
    (args.out / "quant_speed.json").write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out / 'quant_speed.json'} (load average before {load0[0]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
