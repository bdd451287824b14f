"""What the KV canary costs on a decode-heavy run, measured where a shared machine's noise
cannot hide it: the wall time spent inside the canary's own calls (the scheduler's
CanaryMonitor.inputs and .verdicts, the runner's CanaryGuard.after_forward) over the run's total.

    python bench/canary_overhead.py [--sweep 1 4 16] [--bytes none|partial|all] [--new 256]

Same shape as bench/throughput.py's decode workload: 64 prompts of 32-64 tokens, `--new` new
tokens each, greedy, ignore_eos, the default model, `--kv-canary log`. In overlap mode the
runner's share runs on the forward thread and the scheduler's beside it, so the sum is an upper
bound of the loss. Results: docs/kv-canary.md "Cost".
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from collections.abc import Callable
from typing import Any

from runtime import Engine
from runtime.canary.guard import CanaryGuard
from runtime.canary.monitor import CanaryMonitor

SPENT = [0.0]


def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[0] += time.perf_counter() - start
    return wrapper


def run(sweep: int, bytes_mode: str, new: int, threads: int) -> None:
    rng = random.Random(0)
    engine = Engine(num_threads=threads, kv_canary="log", kv_canary_sweep=sweep,
                    kv_canary_bytes=bytes_mode)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(32, 65))] for _ in range(64)]
    engine.generate(prompts[:2], {"temperature": 0, "max_new_tokens": 4})  # warm-up
    SPENT[0] = 0.0
    start = time.perf_counter()
    engine.generate(prompts, {"temperature": 0, "max_new_tokens": new, "ignore_eos": True})
    total = time.perf_counter() - start
    monitor = engine.scheduler.canary
    assert monitor is not None
    print(f"sweep {sweep:3d} bytes {bytes_mode:7s}: {total:6.1f} s, canary {SPENT[0]:5.2f} s "
          f"= {100 * SPENT[0] / total:4.1f} %, checks {monitor.stats.checks}, "
          f"violations {monitor.stats.violations}", flush=True)
    engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--bytes", default="none", choices=("none", "partial", "all"))
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    CanaryMonitor.inputs = timed(CanaryMonitor.inputs)  # type: ignore[method-assign]
    CanaryMonitor.verdicts = timed(CanaryMonitor.verdicts)  # type: ignore[method-assign]
    CanaryGuard.after_forward = timed(CanaryGuard.after_forward)  # type: ignore[method-assign]
    for sweep in args.sweep:
        run(sweep, args.bytes, args.new, args.threads)


if __name__ == "__main__":
    main()
