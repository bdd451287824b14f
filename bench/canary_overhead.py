"""What the KV canary costs on a decode-heavy run, measured in ways a shared machine's noise
hides less than two separate runs of bench/throughput.py (those swung by +-30%).

    python bench/canary_overhead.py --lockstep K [--sweep 1 4 16] [--new 256]
    python bench/canary_overhead.py --interleaved [--sweep 1 4 16] [--repeats 5] [--new 256]
    python bench/canary_overhead.py [--sweep 1 4 16] [--bytes none|partial|all] [--new 256]

`--lockstep K`: side by side, finest. The same engines as below, one run of the workload, the
arms taking turns of K scheduler steps (a few seconds each); each arm's total time over none's
is the loss, and the per-turn ratios show the noise (median and quartiles).

`--interleaved`: side by side, coarser. One engine per arm (`--kv-canary none`, and `log` at
each sweep), all loaded at once; then `--repeats` rounds, each running every arm once on the
same prompts (bench/throughput.py's decode workload: 64 prompts of 32-64 tokens of its corpus, a
new draw each round; `--new` new tokens each, greedy, ignore_eos), in an order rotated round by
round. Slow drifts of the load from elsewhere hit the arms of a round alike (a burst shorter than one
arm's run does not: see the spread); the median over the rounds of each arm's time over the
`none` arm's of the same round, and the range, are printed. Tokens must equal `none`'s.

Default: the share. One run per sweep; the wall time spent inside the canary's own calls (the
scheduler's CanaryMonitor.inputs and .verdicts, the runner's CanaryGuard.after_forward) over the
run's total. In overlap mode the runner's share runs on the forward thread and the scheduler's
beside it, so the sum is an upper bound of the loss. Results: docs/kv-canary.md "Cost".
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from runtime import Engine
from runtime.canary.guard import CanaryGuard
from runtime.canary.monitor import CanaryMonitor

SPENT = [0.0]
GREEDY = {"temperature": 0, "ignore_eos": True}


def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[0] += time.perf_counter() - start
    return wrapper


def share(sweep: int, bytes_mode: str, new: int, threads: int) -> None:
    rng = random.Random(0)
    engine = Engine(num_threads=threads, kv_canary="log", kv_canary_sweep=sweep,
                    kv_canary_bytes=bytes_mode)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(32, 65))] for _ in range(64)]
    engine.generate(prompts[:2], {"temperature": 0, "max_new_tokens": 4})  # warm-up
    SPENT[0] = 0.0
    start = time.perf_counter()
    engine.generate(prompts, {**GREEDY, "max_new_tokens": new})
    total = time.perf_counter() - start
    monitor = engine.scheduler.canary
    assert monitor is not None
    print(f"sweep {sweep:3d} bytes {bytes_mode:7s}: {total:6.1f} s, canary {SPENT[0]:5.2f} s "
          f"= {100 * SPENT[0] / total:4.1f} %, checks {monitor.stats.checks}, "
          f"violations {monitor.stats.violations}", flush=True)
    engine.shutdown()


def arms(sweeps: list[int], bytes_mode: str) -> dict[str, dict[str, Any]]:
    """Arm label -> its engine's canary arguments; `none` first, the baseline."""
    out: dict[str, dict[str, Any]] = {"none": {"kv_canary": "none"}}
    for s in sweeps:
        out[f"log/{s}"] = {"kv_canary": "log", "kv_canary_sweep": s, "kv_canary_bytes": bytes_mode}
    return out


def setup(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Engine]]:
    """The tokenizer, the decode workload with `--prompts` and `--new`, one warm engine per arm."""
    from throughput import WORKLOADS, Workload, build_prompts
    from transformers import AutoTokenizer

    from runtime.model_store import resolve_model_path

    w = WORKLOADS["decode"]
    w = Workload(w.name, args.prompts, w.min_len, w.max_len, args.new)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("builtin:smollm2-135m"))
    pool = w.num_prompts * (w.max_len + w.max_new_tokens) + 1024  # everyone at once
    engines = {label: Engine(num_threads=args.threads, max_total_tokens=pool, **kw)
               for label, kw in arms(args.sweep, args.bytes).items()}
    for engine in engines.values():  # first-call costs stay out of the timings
        engine.generate(build_prompts(tokenizer, w, seed=999)[:4], {**GREEDY, "max_new_tokens": 4})
    print(f"{len(engines)} arms; {w.num_prompts} prompts ({w.min_len}-{w.max_len} tokens) x "
          f"{w.max_new_tokens} new; load avg {os.getloadavg()[0]:.2f}", flush=True)
    return tokenizer, w, engines


def interleaved(args: argparse.Namespace) -> None:
    from throughput import build_prompts

    tokenizer, w, engines = setup(args)
    labels = list(engines)
    wall: dict[str, list[float]] = {label: [] for label in labels}
    cpu: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(args.repeats):
        prompts = build_prompts(tokenizer, w, seed=r + 1)
        order = labels[r % len(labels):] + labels[:r % len(labels)]
        outputs = {}
        for label in order:
            cpu0, wall0 = time.process_time(), time.perf_counter()
            results = engines[label].generate(prompts, {**GREEDY, "max_new_tokens": w.max_new_tokens})
            wall[label].append(time.perf_counter() - wall0)
            cpu[label].append(time.process_time() - cpu0)
            outputs[label] = [res["output_ids"] for res in results]
        assert all(out == outputs["none"] for out in outputs.values()), "the canary changed tokens"
        print(f"round {r + 1}: " + ", ".join(f"{label} {wall[label][-1]:.1f} s ({cpu[label][-1]:.1f} "
                                             "cpu s)" for label in order)
              + f"; load avg {os.getloadavg()[0]:.2f}", flush=True)
        report(wall, cpu)  # so far: a run cut short still says something
    for engine in engines.values():
        engine.shutdown()


def spread(times: list[float], base: list[float]) -> str:
    """Median of the per-round ratios to the baseline, and their range."""
    ratios = [t / b for t, b in zip(times, base, strict=True)]
    return f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"


def report(wall: dict[str, list[float]], cpu: dict[str, list[float]]) -> None:
    """Wall time is what a user waits; CPU seconds (of this process, which runs one arm at a
    time) move far less with the load from elsewhere."""
    print("| arm | median wall s | wall / none: median (min-max) | median CPU s "
          "| CPU / none: median (min-max) |")
    print("|---|---|---|---|---|")
    for label in wall:
        print(f"| {label} | {statistics.median(wall[label]):.1f} | "
              f"{spread(wall[label], wall['none'])} | {statistics.median(cpu[label]):.1f} | "
              f"{spread(cpu[label], cpu['none'])} |", flush=True)


def lockstep(args: argparse.Namespace) -> None:
    """Every arm runs the same requests, taking turns of `--lockstep` scheduler steps: the arms
    schedule alike (the canary changes no decision), so turn i covers the same steps in each,
    and a burst of load from elsewhere lasting a few seconds lands on all of them. A turn ends
    when its last forward has finished (in overlap mode it would run on into the next arm's)."""
    from throughput import build_prompts

    from runtime.sampling_params import SamplingParams
    from runtime.scheduler.req import Req

    tokenizer, w, engines = setup(args)
    labels = list(engines)
    params = SamplingParams.from_dict({**GREEDY, "max_new_tokens": w.max_new_tokens})
    prompts = build_prompts(tokenizer, w, seed=1)
    reqs = {label: [Req(f"{label}-{i}", list(p), params) for i, p in enumerate(prompts)]
            for label in labels}
    for label, engine in engines.items():
        for req in reqs[label]:
            engine.scheduler.add_request(req)
    wall: dict[str, list[float]] = {label: [] for label in labels}
    cpu: dict[str, list[float]] = {label: [] for label in labels}
    turn = 0
    while any(e.scheduler.has_work() for e in engines.values()):
        for label in labels[turn % len(labels):] + labels[:turn % len(labels)]:
            sched = engines[label].scheduler
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for _ in range(args.lockstep):
                if sched.has_work():
                    sched.step()
            if sched.pending is not None:
                sched.pending.result.result()
            wall[label].append(time.perf_counter() - wall0)
            cpu[label].append(time.process_time() - cpu0)
        turn += 1
    tokens = {label: [r.output_ids for r in rs] for label, rs in reqs.items()}
    assert all(t == tokens["none"] for t in tokens.values()), "the canary changed tokens"
    print(f"{turn} turns of {args.lockstep} steps; load avg {os.getloadavg()[0]:.2f}")
    print("| arm | wall s | wall / none | turns: median (quartiles) | CPU s | CPU / none |")
    print("|---|---|---|---|---|---|")
    for label in labels:
        ratios = sorted(t / b for t, b in zip(wall[label], wall["none"], strict=True))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        print(f"| {label} | {sum(wall[label]):.1f} | {sum(wall[label]) / sum(wall['none']):.3f} | "
              f"{q[1]:.3f} ({q[0]:.3f}-{q[2]:.3f}) | {sum(cpu[label]):.1f} | "
              f"{sum(cpu[label]) / sum(cpu['none']):.3f} |", flush=True)
    for engine in engines.values():
        engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--interleaved", action="store_true", help="none vs log side by side")
    p.add_argument("--sweep", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--bytes", default="none", choices=("none", "partial", "all"))
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--prompts", type=int, default=64, help="--interleaved: prompts per round")
    p.add_argument("--repeats", type=int, default=5, help="--interleaved: rounds")
    p.add_argument("--lockstep", type=int, default=0, metavar="K",
                   help="arms take turns of K scheduler steps over one run (0: off)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.lockstep:
        lockstep(args)
        return
    if args.interleaved:
        interleaved(args)
        return
    CanaryMonitor.inputs = timed(CanaryMonitor.inputs)  # type: ignore[method-assign]
    CanaryMonitor.verdicts = timed(CanaryMonitor.verdicts)  # type: ignore[method-assign]
    CanaryGuard.after_forward = timed(CanaryGuard.after_forward)  # type: ignore[method-assign]
    for sweep in args.sweep:
        share(sweep, args.bytes, args.new, args.threads)


if __name__ == "__main__":
    main()
