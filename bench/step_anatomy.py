"""Where a batch-1 decode step's time goes, host and device (issue #40: the 1B and 135M shapes
both took ~1.5 ms a step on an H100, against a weight-read bound of 0.74 / 0.09 ms).

    python bench/step_anatomy.py [--shape 1b] [--steps 128] [--out DIR]   # on the GPU machine
    python bench/step_anatomy.py --smoke                                    # CPU, a 2-layer shape

One 32-token prompt (or --batch N prompts of 20-60 tokens), greedy, `--steps` new tokens, with overlap on and off (decode graphs on, triton
attention on CUDA). For each: the wall time per step; the time each thread spends in each part of
the step loop per step (wall timers on the scheduler's and the runner's methods, this process
only: nothing under runtime/ changes); then torch.profiler (CPU, and CUDA on a GPU) over the same
run: the GPU's busy time per step, the CUDA runtime calls per step, and the host ops by self time.
Writes DIR/step_anatomy.txt.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import SHAPES, prompts, write_model

TIMES: dict[tuple[str, str], float] = defaultdict(float)


def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            thread = "main" if threading.current_thread() is threading.main_thread() else "forward"
            TIMES[(thread, label)] += time.perf_counter() - start

    return wrapper


def instrument() -> None:
    from runtime import device, forward_batch
    from runtime.engine import cuda_graph, model_runner, sampler
    from runtime.forward_batch import ForwardBatch, ForwardOutput
    from runtime.models import llama
    from runtime.scheduler import future, results, scheduler, streamer

    for owner, attr in [
        (scheduler.Scheduler, "step"), (scheduler.Scheduler, "schedule"),
        (scheduler.Scheduler, "launch"), (scheduler.Scheduler, "process"),
        (results.ResultProcessor, "process"),
        (streamer.OutputStreamer, "emit"), (ForwardBatch, "to"), (ForwardOutput, "on_host"),
        (ForwardOutput, "start_host_copy"), (future.FutureMap, "resolve_future"),
        (future.FutureMap, "store"), (model_runner.ModelRunner, "forward_batch"),
        (cuda_graph.DecodeGraphs, "replay"), (llama.LlamaModel, "forward"),
        (sampler.TorchSampler, "sample"),
    ]:
        setattr(owner, attr, timed(f"{owner.__name__}.{attr}", getattr(owner, attr)))
    # the forward thread's whole forward (the scheduler calls it by this module-level name)
    scheduler.run_forward = timed("run_forward", scheduler.run_forward)  # type: ignore[assignment]
    # inside ForwardBatch.to: packing on the host, and the whole of it (pinned buffer, copy)
    for attr in ("_pack", "_unpack"):
        setattr(device, attr, timed(f"device.{attr}", getattr(device, attr)))
    forward_batch.to_device = timed("device.to_device", forward_batch.to_device)  # type: ignore[assignment]


def run(engine: Any, prompt: list[list[int]], new: int) -> float:
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": new}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    engine.generate(prompt, params)
    sync()
    return time.perf_counter() - start


def profile(engine: Any, prompt: list[list[int]], steps: int, out: io.StringIO) -> None:
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        run(engine, prompt, steps + 1)
    events = prof.key_averages()
    if torch.cuda.is_available():
        kernels = [e for e in events if e.device_type.name == "CUDA"]
        busy = sum(e.self_device_time_total for e in kernels) / 1000  # ms
        launches = sum(e.count for e in kernels)
        print(f"  GPU busy {busy / steps:.3f} ms/step, {launches / steps:.1f} device ops/step",
              file=out)
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]:
            print(f"    {e.key[:72]:<72}{e.count / steps:>6.1f}/step"
                  f"{e.self_device_time_total / steps:>8.1f} us/step", file=out)
        runtime_calls = sorted((e for e in events if e.key.startswith("cuda")),
                               key=lambda e: -e.self_cpu_time_total)
        for e in runtime_calls[:10]:
            print(f"    {e.key:<40}{e.count / steps:>7.1f}/step{e.self_cpu_time_total / steps:>9.1f} us/step",
                  file=out)
    host = sorted((e for e in events if not e.key.startswith("cuda")),
                  key=lambda e: -e.self_cpu_time_total)
    print("  host ops by self time:", file=out)
    for e in host[:25]:
        print(f"    {e.key:<48}{e.count / steps:>7.1f}/step{e.self_cpu_time_total / steps:>9.1f} us/step",
              file=out)


def anatomy(path: Path, overlap: bool, steps: int, batch: int, smoke: bool, out: io.StringIO) -> None:
    from runtime import Engine

    device = "cpu" if smoke else "cuda"
    engine = Engine(model=str(path), device=device, dtype="float32" if smoke else "bfloat16",
                    enable_overlap=overlap, max_total_tokens=max(4096, batch * (64 + steps + 2)),
                    max_running_requests=max(batch, 8),
                    attention_backend="auto" if smoke else "triton")
    vocab = engine.runner.vocab_size
    prompt = prompts(1, 32, 32, vocab) if batch == 1 else prompts(batch, 20, 60, vocab)
    try:
        run(engine, prompt, steps + 1)  # warm-up (graphs captured at start-up)
        one = min(run(engine, prompt, 1) for _ in range(3))
        TIMES.clear()
        many = run(engine, prompt, steps + 1)
        step_ms = (many - one) / steps * 1000
        print(f"batch {batch}, overlap {'on' if overlap else 'off'}: {step_ms:.3f} ms/step "
              f"(graphs {'on' if engine.runner.graphs is not None else 'off'})", file=out)
        for (thread, label), secs in sorted(TIMES.items(), key=lambda kv: (kv[0][0], -kv[1])):
            print(f"    {thread:<8}{label:<40}{secs / (steps + 1) * 1000:>8.3f} ms/step", file=out)
        profile(engine, prompt, steps, out)
    finally:
        engine.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--batch", type=int, default=1,
                   help="1: one 32-token prompt; N: N prompts of 20-60 tokens (decode-heavy's)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--smoke", action="store_true", help="CPU, the 2-layer shape")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="sys.setswitchinterval for the run (Python's default is 5 ms): how long "
                        "the forward thread may wait for the GIL while the scheduler runs Python")
    args = p.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    if not args.smoke and not torch.cuda.is_available():
        print("bench/step_anatomy.py needs a CUDA device (or --smoke on the CPU)", file=sys.stderr)
        return 2
    shape = "smoke" if args.smoke else args.shape
    instrument()
    out = io.StringIO()
    print(f"shape {shape}, device {torch.cuda.get_device_name() if not args.smoke else 'cpu'}, "
          f"torch {torch.__version__}, GIL switch interval {sys.getswitchinterval() * 1000:g} ms",
          file=out)
    with tempfile.TemporaryDirectory(prefix="baton-anatomy-") as tmp:
        path = write_model(Path(tmp) / shape, SHAPES[shape],
                           torch.float32 if args.smoke else torch.bfloat16)
        for overlap in (True, False):
            anatomy(path, overlap, args.steps, args.batch, args.smoke, out)
    print(out.getvalue())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_anatomy.txt").write_text(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
