"""Tensor parallelism: tp=1 against tp>1 in one run, the offline Engine and `baton serve`.

    python bench/tp.py [--tiny-tp 1,2,4] [--builtin-tp 1,3] [--serve tiny,builtin] [--out DIR]
    python bench/tp.py --smoke          # a 2-layer tiny model at tp 1 and 2, a few tokens

Models: `tiny`, a random Llama written here (8 heads, 2 KV heads, hidden 256, 4 layers; large
weights, so greedy has margins; the builtin tokenizer), and `builtin`, SmolLM2-135M (9 heads,
3 KV heads: tp=2 does not divide it, tp=3 does). Prompts: windows of bench/throughput.py's text.

Engine (rank 0 is this process, the followers its children), per model and tp, after a check run
that is also the warm-up (greedy, top-2 logprobs):
  out tok/s    one generate() of the batch: greedy, ignore_eos, --new tokens per prompt (the
               fastest of --repeat runs)
  TTFT batch   generate() of the batch with max_new_tokens=1 (median of 3): every prompt's prefill
  TTFT one     the same for the first prompt alone
  tokens       the check run's greedy ids against tp=1's: equal, a near-tie (tp=1's top-2 logprob
               gap under --near-tie at the first divergence: float noise may flip it), or a mismatch
Step anatomy (rank 0, the fastest out-tok/s run, by forward mode): wall ms per scheduler step, per
forward (ModelRunner.forward_batch), in all-reduce (TensorParallel.all_reduce: the embedding's and
2 per layer), in the logits' all-gather (gather_vocab), and in sending each batch to the followers
(Ranks.send, outside the forward). Timers wrap those methods in this process only (runtime/ is
unchanged); a collective's time includes waiting for the slowest rank to reach it. On CUDA every
timer synchronizes the device, so collectives cannot overlap anything while measured, and with
overlap on (CUDA's default) a part may be counted under the mode of the next forward, already sent.
Serve: `baton serve --tp N` per model and tp on a loopback port (bench/tp_serve.py); after one
warm-up request, every prompt at once as a streaming /generate, --repeat times: out tok/s
(tokens / the fastest burst's wall time), TTFT p50 and max in that burst (request sent -> first
chunk with a token), and the greedy ids against tp=1's server (ids only: there a near-tie is not
told from a mismatch). Processes left in the server's process group after it stops are killed
and reported.

Ratios are against the same model's tp=1. Prefix caching is off (repeated prompts would hit it).
Without --num-threads each rank takes cores // tp torch threads (ModelRunner), tp=1 all cores. On
a 2-core CPU tp>1 is not faster: the ranks split the same cores and every layer adds two
collectives over loopback gloo; the numbers are reported as measured. Everything runs in this
process's environment: on cores other jobs share, set GOMP_SPINCOUNT=0 (docs/performance.md);
meta records it. `--device cuda` runs the ranks on GPUs: over nccl with one GPU per rank
(ranks.backend_for), else all on one GPU over gloo.
Writes DIR/tp.json (default bench/results) and prints the tables (bench/tp_report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO)]
# the Engine's followers are `python -m runtime.scheduler.ranks`: the same runtime as this process
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from throughput import Workload, build_prompts, git_describe, log  # noqa: E402
from tp_report import Greedy, add_comparisons, print_report  # noqa: E402
from tp_serve import Server, burst  # noqa: E402

GREEDY = {"temperature": 0, "ignore_eos": True}
TINY: dict[str, Any] = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=2,
                            max_position_embeddings=1024, initializer_range=0.3)
SMOKE_TINY: dict[str, Any] = dict(TINY, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=4)
WORKLOAD = Workload("tp", 8, 32, 96, 32)
SMOKE_WORKLOAD = Workload("tp-smoke", 3, 8, 16, 4)
THREADS = torch.get_num_threads()  # this process's default, restored before each Engine


@dataclass(frozen=True)
class Model:
    name: str
    path: Path
    tps: tuple[int, ...]  # the Engine's
    serve_tps: tuple[int, ...]


# ---- rank 0's clock --------------------------------------------------------------------------
class StepClock:
    """Wall seconds and calls of rank 0's step, forward and collectives, by forward mode: the
    mode is the last forward sent or run (every collective runs inside a forward)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.mode = "none"
        self.tallies: dict[str, dict[str, list[float]]] = {}  # mode -> part -> [calls, seconds]

    def reset(self) -> None:
        self.tallies = {}

    def install(self) -> None:
        from runtime.engine.model_runner import ModelRunner
        from runtime.models.parallel import TensorParallel
        from runtime.scheduler.ranks import Ranks
        from runtime.scheduler.scheduler import Scheduler

        self._wrap(Scheduler, "step", "step", starts_step=True)
        self._wrap(Ranks, "send", "send", batch_arg=True)
        self._wrap(ModelRunner, "forward_batch", "forward", batch_arg=True)
        self._wrap(TensorParallel, "all_reduce", "all_reduce")
        self._wrap(TensorParallel, "gather_vocab", "all_gather")

    def _wrap(self, owner: type, attr: str, part: str, batch_arg: bool = False,
              starts_step: bool = False) -> None:
        fn: Callable[..., Any] = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if starts_step:
                self.mode = "none"
            if batch_arg:
                self.mode = args[1].mode
            self._sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                tally = self.tallies.setdefault(self.mode, {}).setdefault(part, [0, 0.0])
                tally[0] += 1
                tally[1] += time.perf_counter() - start

        setattr(owner, attr, timed)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def summary(self) -> dict[str, dict[str, float]]:
        """Per forward mode: forwards, then ms per forward of each part and calls per forward."""
        out = {}
        for mode, parts in self.tallies.items():
            forwards = parts.get("forward", [0, 0.0])[0]
            if not forwards:
                continue
            row: dict[str, float] = {"forwards": forwards}
            for part, (calls, secs) in parts.items():
                row[f"{part}_ms"] = secs * 1e3 / forwards
                row[f"{part}_calls"] = calls / forwards
            row["collective_share"] = (row.get("all_reduce_ms", 0.0)
                                       + row.get("all_gather_ms", 0.0)) / row["forward_ms"]
            out[mode] = row
        return out


# ---- the Engine ------------------------------------------------------------------------------
def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def engine_case(model: Model, tp: int, prompts: list[list[int]], new: int,
                args: argparse.Namespace, clock: StepClock) -> dict[str, Any]:
    from runtime import Engine
    from runtime.scheduler.ranks import backend_for

    torch.set_num_threads(THREADS)
    threads = {"num_threads": args.num_threads} if args.num_threads else {}
    engine = Engine(model=str(model.path), tp=tp, device=args.device, disable_prefix_cache=True,
                    max_total_tokens=args.max_total_tokens, **threads)
    try:
        check = engine.generate(prompts, {**GREEDY, "max_new_tokens": new}, top_logprobs_num=2)
        batch = statistics.median(timed(lambda: engine.generate(
            prompts, {**GREEDY, "max_new_tokens": 1}))[0] for _ in range(3))
        one = statistics.median(timed(lambda: engine.generate(
            prompts[0], {**GREEDY, "max_new_tokens": 1}))[0] for _ in range(3))
        seconds, results, steps = float("inf"), check, {}
        for _ in range(args.repeat):  # the fastest run, and its steps
            clock.reset()
            took, out = timed(lambda: engine.generate(prompts, {**GREEDY, "max_new_tokens": new}))
            if took < seconds:
                seconds, results, steps = took, out, clock.summary()
        rank_threads = torch.get_num_threads()
    finally:
        engine.shutdown()
    rerun_equal = [r["output_ids"] for r in results] == [r["output_ids"] for r in check]
    return {"model": model.name, "tp": tp, "threads_per_rank": rank_threads,
            "backend": backend_for(args.device, tp) if tp > 1 else None,
            "seconds": seconds, "out_tok_s": len(prompts) * new / seconds,
            "ttft_batch_ms": batch * 1e3, "ttft_one_ms": one * 1e3, "steps": steps,
            "timed_run_equals_check_run": rerun_equal,
            "greedy": [Greedy.of_result(r) for r in check], "error": None}


# ---- `baton serve` ---------------------------------------------------------------------------
def serve_case(model: Model, tp: int, prompts: list[list[int]], new: int,
               args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    extra = ["--tp", str(tp), "--device", args.device, "--disable-prefix-cache",
             "--max-total-tokens", str(args.max_total_tokens)]
    if args.num_threads:
        extra += ["--num-threads", str(args.num_threads)]
    server = Server(model.path, extra, logs / f"serve-{model.name}-tp{tp}.log")
    try:
        burst(server.url, prompts[:1], {**GREEDY, "max_new_tokens": 2})  # warm-up
        runs = [burst(server.url, prompts, {**GREEDY, "max_new_tokens": new})
                for _ in range(args.repeat)]
    finally:
        left = server.end()
    wall, done = min(runs, key=lambda run: run[0])
    ttfts = sorted(t for t, _ in done)
    return {"model": model.name, "tp": tp, "wall_s": wall,
            "out_tok_s": sum(len(ids) for _, ids in done) / wall,
            "ttft_p50_ms": statistics.median(ttfts) * 1e3, "ttft_max_ms": ttfts[-1] * 1e3,
            "left_behind": left, "greedy": [Greedy(ids) for _, ids in done], "error": None}


# ---- the run ---------------------------------------------------------------------------------
def guarded(what: str, model: Model, tp: int, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """fn's row, or a row that names its error (the run goes on to the next case)."""
    log(f"{what} {model.name} tp={tp}")
    try:
        row = fn()
    except Exception as e:
        log(f"{what} {model.name} tp={tp}: FAILED {type(e).__name__}: {e}")
        return {"model": model.name, "tp": tp, "error": f"{type(e).__name__}: {e}"}
    log(f"  {row['out_tok_s']:.1f} out tok/s")
    return row


def build_models(args: argparse.Namespace, tmp: Path) -> list[Model]:
    from runtime.model_store import resolve_model_path
    from tests.models.checkpoints import write_checkpoint

    builtin = resolve_model_path("builtin:smollm2-135m")
    shape = SMOKE_TINY if args.smoke else TINY
    tiny = write_checkpoint("LlamaConfig", tmp / "tiny-llama", builtin, **shape)
    serve = set(args.serve)
    models = [Model("tiny", tiny, args.tiny_tp, args.tiny_tp if "tiny" in serve else ()),
              Model("builtin", builtin, args.builtin_tp,
                    args.builtin_tp if "builtin" in serve else ())]
    return [m for m in models if m.tps or m.serve_tps]


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    models = build_models(args, tmp)
    workload = SMOKE_WORKLOAD if args.smoke else WORKLOAD
    workload = Workload(workload.name, workload.num_prompts, workload.min_len, workload.max_len,
                        args.new or workload.max_new_tokens)
    prompts = build_prompts(AutoTokenizer.from_pretrained(models[0].path), workload)
    new = workload.max_new_tokens
    clock = StepClock(cuda=args.device.startswith("cuda"))
    clock.install()
    engine = [guarded("engine", m, tp, partial(engine_case, m, tp, prompts, new, args, clock))
              for m in models for tp in m.tps]
    serve = [guarded("serve", m, tp, partial(serve_case, m, tp, prompts, new, args, tmp))
             for m in models for tp in m.serve_tps]
    shapes = {m.name: json.loads((m.path / "config.json").read_text()) for m in models}
    return {"workload": asdict(workload), "near_tie": args.near_tie, "engine": engine,
            "serve": serve, "models": {name: {k: c.get(k) for k in (
                "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size")} for name, c in shapes.items()}}


def tps(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="a 2-layer tiny model at tp 1,2 (engine and serve), 3 prompts, 4 tokens")
    p.add_argument("--tiny-tp", type=tps, default=None, help="the tiny model's sizes (1,2,4)")
    p.add_argument("--builtin-tp", type=tps, default=None, help="SmolLM2-135M's sizes (1,3)")
    p.add_argument("--serve", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help="models also run under `baton serve` (tiny,builtin)")
    p.add_argument("--new", type=int, default=None, help="new tokens per prompt (32; smoke 4)")
    p.add_argument("--repeat", type=int, default=None,
                   help="timed runs per case, the fastest reported (3; smoke 1)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads per rank")
    p.add_argument("--max-total-tokens", type=int, default=4096, help="each rank's KV pool")
    p.add_argument("--near-tie", type=float, default=1e-3,
                   help="a top-2 logprob gap under which a flipped greedy token is float noise "
                        "(1e-3 suits float32)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    if args.serve is not None and set(args.serve) - {"tiny", "builtin"}:
        p.error(f"--serve takes tiny and builtin, not {args.serve}")
    smoke = args.smoke
    args.tiny_tp = args.tiny_tp if args.tiny_tp is not None else (1, 2) if smoke else (1, 2, 4)
    args.builtin_tp = args.builtin_tp if args.builtin_tp is not None else () if smoke else (1, 3)
    args.serve = args.serve if args.serve is not None else ["tiny"] if smoke else ["tiny", "builtin"]
    args.repeat = args.repeat or (1 if smoke else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, load0 = time.perf_counter(), os.getloadavg()
    log(f"load average {load0[0]:.2f} on {os.cpu_count()} CPUs, device {args.device}")
    with tempfile.TemporaryDirectory(prefix="baton-tp-") as tmp:
        report = run(args, Path(tmp))
    add_comparisons(report)
    report["meta"] = {
        "smoke": args.smoke, "device": args.device, "cpus": os.cpu_count(),
        "torch": torch.__version__, "default_threads": THREADS, "load_avg_start": list(load0),
        "openmp_env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                                      "GOMP_SPINCOUNT")},
        "load_avg_end": list(os.getloadavg()), "run_seconds": time.perf_counter() - started,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git_describe()}
    print_report(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tp.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.out / 'tp.json'}; total run time {report['meta']['run_seconds']:.0f} s")
    failed = [r for r in report["engine"] + report["serve"] if r.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
