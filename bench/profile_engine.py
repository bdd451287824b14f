"""Where baton's Engine spends its time on a throughput workload (default: decode-heavy).

    python bench/profile_engine.py [--workload decode] [--max-new-tokens N] [--overlap]

Wraps (in this process only; nothing under runtime/ changes) the model runner, the model
forward, the attention backend, every `Linear` call, the sampler and the scheduler step with wall
timers, runs the workload once after a warm-up, and prints the breakdown. Overlap is off by
default so the parts add up to the wall time; with --overlap the forward runs on the worker
thread and the scheduler column shows only what the main thread did.
A torch.profiler op table over a few decode steps follows (--torch-profile).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TIMES: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - start
            CALLS[name] += 1

    return wrapper


def instrument(engine: Any) -> None:
    """Patch the classes' methods with timers."""
    from runtime.attention import cpu_backend, torch_backend
    from runtime.engine import model_runner
    from runtime.kvcache import pool
    from runtime.models import linear, llama, rope
    from runtime.scheduler import scheduler

    patches: list[tuple[Any, str, str]] = [
        (scheduler.Scheduler, "step", "scheduler.step (total)"),
        (model_runner.ModelRunner, "forward_batch", "runner.forward_batch"),
        (llama.LlamaModel, "forward", "model.forward"),
        (torch_backend.TorchAttention, "begin", "attn.begin (slot table, mask)"),
        (torch_backend.TorchAttention, "_decode", "attn.decode (gather + sdpa)"),
        (torch_backend.TorchAttention, "_extend", "attn.extend (sdpa)"),
        (cpu_backend.CpuAttention, "begin", "attn.begin (slot table, mask)"),
        (cpu_backend.CpuAttention, "_decode", "attn.decode (native kernel)"),
        (pool.KVPool, "write", "kv.write"),
        (linear.Linear, "__call__", "matmuls (Linear, incl. lm_head)"),
        # the model module's own names, whichever of them this version of llama.py uses
        (llama, "rms_norm", "rms_norm"),
        (llama, "apply_rope", "rope"),
        (rope.RotaryEmbedding, "__call__", "rope"),
        (rope.RotaryEmbedding, "lookup", "rope"),
    ]
    for owner, attr, label in patches:
        if attr in vars(owner):
            setattr(owner, attr, timed(label, getattr(owner, attr)))
    sampler_cls = type(engine.runner.sampler)
    sampler_cls.sample = timed("sampler.sample", sampler_cls.sample)  # type: ignore[method-assign]


def report(wall: float, gen_tokens: int, steps: int) -> None:
    print(f"\nwall {wall:.2f} s, {gen_tokens} generated tokens, {gen_tokens / wall:.1f} tok/s, "
          f"{steps} scheduler steps ({1000 * wall / max(steps, 1):.1f} ms/step)")
    print(f"{'component':<36}{'seconds':>9}{'% wall':>8}{'calls':>9}{'ms/call':>9}")
    for name, secs in sorted(TIMES.items(), key=lambda kv: -kv[1]):
        calls = CALLS[name]
        print(f"{name:<36}{secs:>9.2f}{100 * secs / wall:>7.1f}%{calls:>9}{1000 * secs / calls:>9.3f}")
    model = TIMES.get("model.forward", 0.0)
    runner = TIMES.get("runner.forward_batch", 0.0)
    step = TIMES.get("scheduler.step (total)", 0.0)
    print("\nderived:")
    print(f"  runner outside model.forward (sampling, logits rows): {runner - model:.2f} s")
    print(f"  scheduler.step outside runner (Python policy, batch building, outputs): "
          f"{step - runner:.2f} s  (meaningful with overlap off)")
    print(f"  model.forward outside matmuls/attention/norm/rope: "
          f"{model - sum(TIMES.get(k, 0.0) for k in _INSIDE_MODEL):.2f} s")


_INSIDE_MODEL = (
    "matmuls (Linear, incl. lm_head)", "attn.begin (slot table, mask)",
    "attn.decode (gather + sdpa)", "attn.decode (native kernel)", "attn.extend (sdpa)",
    "kv.write", "rms_norm", "rope",
)


@contextmanager
def torch_profile(enabled: bool, path: Path) -> Iterator[None]:
    if not enabled:
        yield
        return
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    print("\ntorch.profiler, self CPU time by op:\n" + table)
    path.write_text(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", choices=("prefill", "decode"), default="decode")
    p.add_argument("--max-new-tokens", type=int, default=None, help="override the workload's")
    p.add_argument("--num-prompts", type=int, default=None, help="override the workload's")
    p.add_argument("--overlap", action="store_true", help="keep enable_overlap on")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--torch-profile", type=int, default=0, metavar="STEPS",
                   help="also run STEPS decode tokens under torch.profiler")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import dataclasses

    from throughput import WORKLOADS, build_prompts

    from runtime import Engine

    w = WORKLOADS[args.workload]
    w = dataclasses.replace(
        w, max_new_tokens=args.max_new_tokens or w.max_new_tokens,
        num_prompts=args.num_prompts or w.num_prompts,
    )
    engine = Engine(num_threads=args.threads, enable_overlap=args.overlap)
    prompts = build_prompts(engine.tokenizer, w)
    params = {"max_new_tokens": w.max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    engine.generate(prompts[:4], {**params, "max_new_tokens": 4})  # warm-up
    instrument(engine)
    cpu, start = time.process_time(), time.perf_counter()
    engine.generate(prompts, params)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu
    print(f"{w.name}-heavy, {w.num_prompts} prompts x {w.max_new_tokens} new tokens, "
          f"overlap {'on' if args.overlap else 'off'}, {args.threads} threads, "
          f"load avg {os.getloadavg()[0]:.2f}, cpu/wall {cpu / wall:.2f}")
    report(wall, w.num_prompts * w.max_new_tokens, CALLS["scheduler.step (total)"])
    if args.torch_profile:
        args.out.mkdir(parents=True, exist_ok=True)
        with torch_profile(True, args.out / "profile_ops.txt"):
            engine.generate(prompts, {**params, "max_new_tokens": args.torch_profile})
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
