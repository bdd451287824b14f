"""The quality gate of a precision mode: teacher-forced next-token agreement with full precision.

    python bench/quality.py [--model builtin:smollm2-135m] [--modes bfloat16] [--out DIR]

The text is bench/data/quality.txt (natural prose written for this gate and used for nothing
else: no test, bench or prompt reads it), tokenized by the model's tokenizer and cut into
windows of at most --window tokens. Each window runs through baton's own forward in chunked
prefill, once in float32 (the reference) and once in each mode, every position's logits kept.
For each position (the token after it is known: teacher forcing) the gate compares:
  agreement   the mode's top token equals float32's (the share of positions, %)
  |dlogprob|  |logprob of float32's top token under the mode - under float32|, mean and p99
A mode passes when its agreement reaches its target (issue 38: int8 >= 98 %, int4 >= 95 %,
fp8 KV >= 99 %, fp8 weights >= 97 %; bf16 has none: it is the reference point). Modes:
EngineConfig dtypes (bfloat16, float16), and `int8` / `int4` (--quantization) measured where
they compute least exactly: every position as a one-row step through the quantized kernel (bf16
activations); their prefill path (the same rounded weights dequantized, fp32 activations) is
`int8-prefill` / `int4-prefill`. `fp8-kv` (--kv-cache-dtype fp8_e4m3, float32 otherwise) runs
every position as a one-row step too: each then reads its whole context from the fp8 pages.
`fp8` is `--quantization fp8` (a CUDA mode) emulated on the CPU: weights per output channel and
activations per token in fp8, their product in float32 (runtime/models/fp8_linear.py
`reference_gemm`): fp8's rounding alone, without the bf16 output of a GPU's GEMM.
Writes DIR/quality.json (default DIR: bench/results).
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
TEXT = HERE / "data" / "quality.txt"
TARGETS = {"int8": 98.0, "int4": 95.0, "fp8-kv": 99.0, "fp8": 97.0}  # agreement, %


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--modes", default="bfloat16", help="comma-separated: bfloat16, float16, int8, int8-prefill, int4, int4-prefill, "
                   "fp8-kv, fp8 (weights and activations, emulated in float32)")
    p.add_argument("--window", type=int, default=560, help="tokens per window (default 560)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (default 256)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=HERE / "results")
    return p.parse_args(argv)


def windows(ids: list[int], size: int) -> list[list[int]]:
    """`ids` cut into near-equal windows of at most `size` tokens."""
    n = -(-len(ids) // size)
    step = -(-len(ids) // n)
    return [ids[i:i + step] for i in range(0, len(ids), step)]


def all_logits(runner: Any, ids: list[int], chunk: int) -> Any:
    """Every position's logits [T, vocab] (float32) for `ids`, prefilled in chunks."""
    import torch

    from runtime.sampling_params import SamplingParams
    from runtime.scheduler.batch import ScheduleBatch
    from runtime.scheduler.req import Req

    req = Req("quality", ids, SamplingParams(max_new_tokens=1, temperature=0.0))
    out = []
    try:
        for lo in range(0, len(ids), chunk):
            hi = min(lo + chunk, len(ids))
            batch = ScheduleBatch(reqs=[req], extend_lens=[hi - lo], is_last_chunk=[hi == len(ids)])
            fb = batch.prepare_for_extend(runner.kv)
            out.append(runner.model.forward(fb, runner.attn, None).float())
    finally:
        runner.kv.release(req)
    return torch.cat(out)


# mode -> (EngineConfig fields, prefill chunk: None for --chunk)
MODES: dict[str, tuple[dict[str, Any], int | None]] = {
    "int8": ({"dtype": "float32", "quantization": "int8", "quant_max_rows": 1}, 1),
    "int8-prefill": ({"dtype": "float32", "quantization": "int8", "quant_max_rows": 0}, None),
    "int4": ({"dtype": "float32", "quantization": "int4", "quant_max_rows": 1}, 1),
    "int4-prefill": ({"dtype": "float32", "quantization": "int4", "quant_max_rows": 0}, None),
    # fp8 KV pages, float32 otherwise; every position a one-row step, so each reads all of its
    # context (its own token's K/V too) from the fp8 pool
    "fp8-kv": ({"dtype": "float32", "kv_cache_dtype": "fp8_e4m3", "attention_backend": "torch"}, 1),
    # `--quantization fp8` (a CUDA mode) emulated: each layer's weight in fp8 per output channel,
    # each row of activations in fp8 per token, their product in float32 (fp8_linear.py
    # reference_gemm), so what is measured is fp8's rounding alone; on a GPU the GEMM's bf16
    # output adds bf16's own cost on top
    "fp8": ({"dtype": "float32"}, None),
}


def run_mode(model: str, mode: str, parts: list[list[int]], chunk: int) -> list[Any]:
    from runtime.config import EngineConfig
    from runtime.engine.model_runner import ModelRunner

    fields, mode_chunk = MODES.get(mode, ({"dtype": mode}, None))
    longest = max(len(p) for p in parts)
    config = EngineConfig(model=model, max_total_tokens=4 * longest, **fields)
    runner = ModelRunner(config, 1)
    if mode == "fp8":  # --quantization fp8's rounding, through the float32 reference product
        from runtime.models.fp8_linear import quantize_fp8, reference_gemm

        quantize_fp8(runner.model, reference_gemm)
    return [all_logits(runner, p, mode_chunk or chunk) for p in parts]


def compare(ref: list[Any], got: list[Any]) -> dict[str, float]:
    import torch

    agree, deltas = 0, []
    for r, g in zip(ref, got, strict=True):
        r, g = r[:-1], g[:-1]  # the last position predicts past the window
        top = r.argmax(-1)
        agree += int((g.argmax(-1) == top).sum())
        lr = torch.log_softmax(r, -1).gather(-1, top[:, None])
        lg = torch.log_softmax(g, -1).gather(-1, top[:, None])
        deltas.append((lr - lg).abs().flatten())
    d = torch.cat(deltas)
    return {"positions": int(d.numel()), "agreement_pct": 100.0 * agree / d.numel(),
            "mean_abs_dlogprob": float(d.mean()), "p99_abs_dlogprob": float(d.quantile(0.99))}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    sys.path.insert(0, str(HERE.parent))
    import torch
    from transformers import AutoTokenizer

    from runtime.model_store import resolve_model_path

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    parts = windows(tokenizer.encode(TEXT.read_text()), args.window)
    print(f"{sum(map(len, parts))} tokens of {TEXT.name} in {len(parts)} windows", flush=True)
    started = time.perf_counter()
    reference = run_mode(args.model, "float32", parts, args.chunk)
    rows: dict[str, dict[str, Any]] = {}
    for mode in filter(None, args.modes.split(",")):
        row: dict[str, Any] = compare(reference, run_mode(args.model, mode, parts, args.chunk))
        target = TARGETS.get(mode.removesuffix("-prefill"))
        row["target_pct"] = target
        row["passes"] = None if target is None else row["agreement_pct"] >= target
        rows[mode] = row
    print(f"\n{'mode':<10} {'positions':>9} {'agree %':>8} {'mean|dlp|':>10} {'p99|dlp|':>9}  gate")
    for mode, r in rows.items():
        gate = "no target" if r["target_pct"] is None else (
            f">= {r['target_pct']}: {'PASS' if r['passes'] else 'FAIL'}")
        print(f"{mode:<10} {r['positions']:>9} {r['agreement_pct']:>8.2f} "
              f"{r['mean_abs_dlogprob']:>10.4f} {r['p99_abs_dlogprob']:>9.4f}  {gate}")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"model": args.model, "text": TEXT.name, "window": args.window, "modes": rows,
              "seconds": round(time.perf_counter() - started, 1)}
    (args.out / "quality.json").write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out / 'quality.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
