"""Throughput of baton's Engine against HF transformers, in one run, on the same prompts and threads.

    python bench/throughput.py [--workload prefill|decode|both] [--quick] [--out DIR]
                               [--model builtin:smollm2-135m|moe|FOLDER]

`--model moe` runs a Qwen3-MoE-shaped model with random weights (8 experts, top-2; written once
by bench/moe_model.py): the MoE workload of issue 37.

Systems (fp32, greedy, exactly `max_new_tokens` tokens per prompt; see bench/throughput_systems.py):
  hf_static         `model.generate`, consecutive batches of 8, left padding, min_new_tokens=max
  generate_batch    transformers' continuous batching (SDPA paged), EOS disabled, baton's KV
                    capacity, step limits tuned for this CPU (--gb-config mirror: baton's)
  hf_forward_bound  the sum of HF's forward times alone: the cheaper of per-prompt or one padded
                    batch prefill + one decode batch of all prompts over a DynamicCache; no
                    sampling, no scheduling (precise definition: bench/throughput_systems.py)
  baton             `Engine.generate(prompts, {temperature 0, ignore_eos})` after a warm-up

Workloads (prompts are deterministic slices of a fixed text, tokenized by the model's tokenizer):
  prefill   32 prompts of 80-260 tokens, 64 new tokens
  decode    64 prompts of 32-64 tokens, 256 new tokens

Writes DIR/throughput.json and DIR/throughput.png (default DIR: bench/results); the table and
the targets of issue 2 are in bench/throughput_report.py. Run it on an idle machine: with two
cores, any other CPU-heavy job makes the OpenMP threads wait on each other and inflates every
time several-fold; the cpu/wall column (CPU seconds per wall second) shows when that happened.
The bound is HF's forward cost for the work, not a ceiling: a system that prefills several
prompts per forward can beat it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from throughput_report import plot, print_report, ratios, sanity, targets

SYSTEMS = ("hf_static", "generate_batch", "hf_forward_bound", "baton")
# Prompts are windows of this text (wrapping around), so every run sees the same token ids.
CORPUS = """\
The harbour town woke before the sun. Fishing boats slid out past the breakwater one by one, their
engines coughing in the cold, while the bakers on the hill pulled the first trays of bread from
ovens that had been burning since midnight. By six the market square was full of voices: traders
arguing over the price of mackerel, children racing between the stalls, an old man tuning a violin
under the clock tower as if the whole square had come to hear him. Nobody had, of course, but he
played anyway, and a few people stopped.
In the library at the end of the square a young archivist named Mira was sorting letters that had
arrived from an estate sale in the north. Most were ordinary: receipts for coal, invitations to
weddings long since forgotten, a complaint about a neighbour's goats. But tucked between two
ledgers she found a bundle tied with blue ribbon, and the first page carried a map of the coast
drawn by hand, with a small cross marked on an island she had never heard of.
Mathematics has a habit of turning up where it is least expected. The spiral of a shell, the
branching of a river delta and the way traffic jams form on a motorway can all be described by a
handful of equations, and engineers who design bridges, compilers and power grids rely on the same
few ideas again and again: conservation, feedback, and the careful accounting of what flows where.
A scheduler in a computer is not so different from a harbour master. Ships arrive at unpredictable
times, berths are limited, and every minute a vessel waits costs someone money. The harbour master
keeps a queue, admits ships when there is room, and sometimes asks a large ship to wait so that
three small ones can unload first. When a storm comes, the plan changes and the queue is rebuilt.
Mira unfolded the map on the reading table and weighed its corners down with pencils. The ink had
faded to brown, but the coastline was unmistakable: the long curve of the bay, the two lighthouses,
the shoal that had wrecked a dozen ships in her grandmother's time. The island, though, was wrong.
Every chart she knew showed open water there, deep and cold, and yet the cross was drawn firmly, as
if the writer had pressed hard with the pen to be sure nobody could doubt it.
Recipes travel the way stories do. A stew cooked in one valley is carried over the mountains by a
shepherd, changed a little by a cook who has no saffron, changed again by a sailor who adds salted
fish, until three generations later nobody remembers where it began. What survives is the method:
brown the onions slowly, add the liquid in stages, taste often, and never hurry the final hour.
That evening the violinist was still playing when Mira locked the library door. She stood for a
while listening, the bundle of letters under her arm, and watched the lights of the returning boats
draw lines across the dark water. Tomorrow she would ask the harbour master about the island.
"""


@dataclass(frozen=True)
class Workload:
    name: str
    num_prompts: int
    min_len: int
    max_len: int
    max_new_tokens: int


WORKLOADS = {
    "prefill": Workload("prefill", 32, 80, 260, 64),
    "decode": Workload("decode", 64, 32, 64, 256),
}
QUICK = {
    "prefill": Workload("prefill", 4, 80, 120, 4),
    "decode": Workload("decode", 4, 32, 48, 8),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def silent(msg: str) -> None:
    pass


@contextmanager
def heartbeat(label: str, every: float = 30.0) -> Iterator[None]:
    """Print a line every `every` seconds while a long, silent call runs."""
    stop = threading.Event()
    start = time.perf_counter()

    def beat() -> None:
        while not stop.wait(every):
            log(f"  ... {label} still running, {time.perf_counter() - start:.0f} s")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def build_prompts(tokenizer: Any, w: Workload, seed: int = 0) -> list[list[int]]:
    corpus = tokenizer.encode(CORPUS, add_special_tokens=False)
    rng = random.Random(seed * 1000 + w.num_prompts * 7 + w.max_len)
    prompts = []
    for _ in range(w.num_prompts):
        length, start = rng.randint(w.min_len, w.max_len), rng.randrange(len(corpus))
        prompts.append([corpus[(start + i) % len(corpus)] for i in range(length)])
    return prompts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", choices=("prefill", "decode", "both"), default="both")
    p.add_argument("--quick", action="store_true", help="tiny workloads (smoke run)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--model", default="builtin:smollm2-135m",
                   help="HF folder, builtin:NAME, or moe (a Qwen3-MoE-shaped random model: "
                   "bench/moe_model.py)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (all systems)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    p.add_argument(
        "--gb-config", choices=("tuned", "mirror"), default="tuned",
        help="generate_batch step limits: the fastest found on this CPU (see GB_TUNED in\n"
             "throughput_systems.py), or baton's own (chunked_prefill_size, max_running_requests)",
    )
    p.add_argument("--check", type=int, default=8, help="prompts compared for token equality")
    p.add_argument(
        "--engine-arg", action="append", default=[], metavar="KEY=VALUE",
        help="extra baton Engine argument (repeatable), e.g. chunked_prefill_size=512",
    )
    return p.parse_args(argv)


def engine_args(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


class Bench:
    """Loads every system once, then times each one on each workload."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from runtime.model_store import resolve_model_path

        torch.set_num_threads(args.threads)
        self.args = args
        self.systems = [s for s in args.systems.split(",") if s]
        if args.model == "moe":
            from moe_model import moe_model

            args.model = str(moe_model())
        path = resolve_model_path(args.model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id
        log(f"loading HF models from {path}")
        self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        # generate_batch switches the attention implementation of the model it runs; keep that
        # away from the model the static and bound runs use.
        self.hf_cb = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        # a smoke run needs no 32k-token KV pool (allocating it dominates a tiny run)
        small = {"max_total_tokens": 4096} if args.quick else {}
        self.engine_kwargs = {"num_threads": args.threads, **small, **engine_args(args.engine_arg)}
        self.engine: Any = None
        if "baton" in self.systems:
            from runtime import Engine

            log(f"starting baton Engine {self.engine_kwargs}")
            self.engine = Engine(model=args.model, **self.engine_kwargs)
        self._warm_up()

    def _warm_up(self) -> None:
        """One tiny run of each system, so first-call costs stay out of the timings."""
        prompts = build_prompts(self.tokenizer, Workload("warmup", 3, 16, 48, 3), seed=1)
        for name in self.systems:
            start = time.perf_counter()
            try:
                self.runner(name, prompts, 3, quiet=True)()
            except Exception as exc:  # the timed run reports it
                log(f"warm-up {name} failed: {type(exc).__name__}: {exc}")
            log(f"warmed up {name} ({time.perf_counter() - start:.1f} s)")

    def _cb_config(self) -> Any:
        import throughput_systems as sysmod

        from runtime.config import EngineConfig, SchedulerConfig

        kw = self.engine_kwargs
        kv_tokens = kw.get("max_total_tokens", EngineConfig.max_total_tokens)
        if self.args.gb_config == "tuned":
            return sysmod.generate_batch_config(**sysmod.GB_TUNED, kv_tokens=kv_tokens)
        return sysmod.generate_batch_config(
            max_batch_tokens=kw.get("chunked_prefill_size", SchedulerConfig.chunked_prefill_size),
            max_requests=kw.get("max_running_requests", SchedulerConfig.max_running_requests),
            kv_tokens=kv_tokens,
        )

    def runner(
        self, name: str, prompts: list[list[int]], max_new: int, quiet: bool = False
    ) -> Callable[[], Any]:
        import throughput_systems as sysmod

        say = silent if quiet else log
        if name == "hf_static":
            return lambda: sysmod.run_hf_static(self.hf, prompts, max_new, self.pad_id, say)
        if name == "generate_batch":
            cfg = self._cb_config()
            return lambda: sysmod.run_generate_batch(self.hf_cb, prompts, max_new, cfg, say)
        if name == "hf_forward_bound":
            return lambda: sysmod.run_forward_bound(self.hf, prompts, max_new, self.pad_id, say)
        if name == "baton":
            return lambda: sysmod.run_baton(self.engine, prompts, max_new, say)
        raise ValueError(f"unknown system {name!r}; known: {SYSTEMS}")

    def run_workload(self, w: Workload) -> dict[str, Any]:
        prompts = build_prompts(self.tokenizer, w)
        prompt_tokens = sum(len(p) for p in prompts)
        gen_tokens = len(prompts) * w.max_new_tokens
        log(f"workload {w.name}: {len(prompts)} prompts, {prompt_tokens} prompt tokens, "
            f"{w.max_new_tokens} new tokens each ({gen_tokens} generated)")
        rows: dict[str, dict[str, Any]] = {}
        outputs: dict[str, list[list[int]]] = {}
        for name in self.systems:
            load_before = os.getloadavg()[0]
            log(f"{w.name}/{name}: start (load avg {load_before:.2f})")
            row: dict[str, Any] = {"load_avg_1m_before": load_before}
            cpu0, wall0 = time.process_time(), time.perf_counter()
            try:
                with heartbeat(f"{w.name}/{name}"):
                    result = self.runner(name, prompts, w.max_new_tokens)()
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
                log(f"{w.name}/{name}: FAILED {row['error']}")
            else:
                outputs[name] = result.outputs
                row.update(seconds=result.seconds, gen_tok_s=gen_tokens / result.seconds,
                           total_tok_s=(prompt_tokens + gen_tokens) / result.seconds,
                           extra=result.extra, error=None)
                log(f"{w.name}/{name}: {result.seconds:.1f} s, {row['gen_tok_s']:.1f} gen tok/s")
            # CPU seconds of this process per wall second: ~threads when it had the cores to
            # itself, clearly less when something else on the machine took them.
            row["cpu_per_wall"] = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
            row["load_avg_1m_after"] = os.getloadavg()[0]
            rows[name] = row
        return {
            "workload": asdict(w), "prompt_tokens": prompt_tokens, "generated_tokens": gen_tokens,
            "systems": rows, "ratios": ratios(rows), "targets": targets(w.name, rows),
            "sanity": sanity(outputs, self.args.check),
        }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # before torch is imported
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    started = time.perf_counter()
    load0 = os.getloadavg()
    log(f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} on {os.cpu_count()} CPUs")
    if load0[0] > 1.0:
        log("WARNING: the machine is busy; timings will be noisy")
    bench = Bench(args)
    chosen = ("prefill", "decode") if args.workload == "both" else (args.workload,)
    table = QUICK if args.quick else WORKLOADS
    results = {name: bench.run_workload(table[name]) for name in chosen}
    if bench.engine is not None:
        bench.engine.shutdown()
    for name, res in results.items():
        print_report(name, res)
    elapsed = time.perf_counter() - started
    report = {"meta": meta(args, load0, elapsed), "workloads": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "throughput.json").write_text(json.dumps(report, indent=2))
    try:
        plot(results, args.out / "throughput.png")
    except ImportError as exc:
        log(f"no plot: {exc}")
    log(f"wrote {args.out / 'throughput.json'}; total run time {elapsed:.0f} s")
    return 0


def meta(args: argparse.Namespace, load0: tuple[float, ...], elapsed: float) -> dict[str, Any]:
    import torch
    import transformers

    return {
        "model": args.model, "threads": args.threads, "quick": args.quick,
        "gb_config": args.gb_config,
        "engine_args": engine_args(args.engine_arg), "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "cpus": os.cpu_count(), "load_avg_start": list(load0),
        "load_avg_end": list(os.getloadavg()), "run_seconds": elapsed,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git_describe(),
    }


def git_describe() -> str | None:
    """The commit measured, '+dirty' when runtime/ has uncommitted changes (read-only git)."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "runtime"], cwd=repo,
                               text=True, capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


if __name__ == "__main__":
    sys.exit(main())
