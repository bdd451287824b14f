"""baton against HF transformers' static `generate` on a GPU, side by side in one run (issue #10).

    python bench/gpu.py [--shapes 135m,1b] [--out DIR]        # on the lent GPU machine:
    bash gpu/run.sh python3 bench/gpu.py --out "$OUT"           # (carry .whl: gpu/prepare.sh)
    python bench/gpu.py --smoke                                 # CPU: checks the script only

Shapes (bf16, random-initialised weights written here; speed does not depend on the values):
  135m  the builtin model's architecture (SmolLM2-135M: 30 layers, hidden 576, 9/3 heads)
  1b    a Llama shape: hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192
Workloads (token ids drawn from a fixed seed, so every run sees the same prompts):
  prefill-heavy  64 prompts of 100-300 tokens, 128 new tokens each
  decode-heavy   256 prompts of 20-60 tokens, 256 new tokens each
Systems (greedy, exactly max_new tokens per prompt):
  hf_static  `model.generate(cache_implementation="static")`, consecutive batches of 64, left
             padding, min_new_tokens = max_new_tokens, after one warm-up batch; on CUDA
             transformers compiles that forward on its own, so it runs both ways (compiled and
             `disable_compile=True`) and the faster is the peer the ratios use
  baton      `Engine.generate` (decode graphs, overlap), after a warm-up: with triton attention,
             and with flashinfer's where it is installed (decode graphs too)
Batch-1 decode step: one 32-token prompt, the time per token of 129 new tokens minus 1, against
the weight-read bound = weight bytes / the device's copy bandwidth (bytes read plus bytes written
by a 1 GiB device-to-device copy, per second): a decode step must read every weight once.
Writes DIR/gpu.json (default bench/results) and prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES: dict[str, dict[str, int]] = {
    "135m": {},
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 8192, "head_dim": 64},
    "smoke": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "head_dim": 16},
}
WORKLOADS = {  # name: (prompts, min tokens, max tokens, new tokens)
    "prefill-heavy": (64, 100, 300, 128),
    "decode-heavy": (256, 20, 60, 256),
}
SMOKE_WORKLOADS = {"prefill-heavy": (4, 10, 30, 6), "decode-heavy": (6, 5, 12, 10)}
HF_BATCH = 64


def model_files() -> Path:
    """The builtin model's config and tokenizer: carried in .whl/model, or the prepared one."""
    carried = REPO / ".whl" / "model"
    if (carried / "config.json").exists():
        return carried
    from runtime.model_store import resolve_model_path

    return resolve_model_path("builtin:smollm2-135m")


def write_model(dest: Path, shape: dict[str, int], dtype: torch.dtype) -> Path:
    import transformers

    src = model_files()
    config = transformers.AutoConfig.from_pretrained(src, **shape)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # fast init on the GPU
        model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(dest)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dest / name)
    return dest


def prompts(n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    rng = random.Random(n * 1000 + hi)
    return [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def hf_static(path: Path, work: list[list[int]], new: int, dtype: torch.dtype, device: str,
              compiled: bool) -> float:
    """Tokens per second of HF static generate over consecutive batches of HF_BATCH; `compiled`:
    as transformers runs it by default (it compiles a static-cache forward on CUDA), else with
    disable_compile=True."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    pad = 0

    def run(batch: list[list[int]]) -> None:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad, cache_implementation="static",
                                 disable_compile=not compiled)
        assert out.shape[1] == width + new

    batches = [work[i : i + HF_BATCH] for i in range(0, len(work), HF_BATCH)]
    run(batches[0])  # warm-up
    seconds = timed(lambda: [run(b) for b in batches], device)
    return len(work) * new / seconds


def baton_engine(path: Path, device: str, dtype: str, smoke: bool, attention: str) -> Any:
    from runtime import Engine

    memory: dict[str, Any] = ({"max_total_tokens": 8192} if smoke else {"mem_fraction_static": 0.8})
    return Engine(model=str(path), device=device, dtype=dtype, max_running_requests=256,
                  chunked_prefill_size=16384, attention_backend=attention, **memory)


def baton(engine: Any, work: list[list[int]], new: int, device: str) -> float:
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": new}
    engine.generate(work[:8], {**params, "max_new_tokens": 4})  # warm-up
    results: list[dict[str, Any]] = []
    seconds = timed(lambda: results.extend(engine.generate(work, params)), device)
    assert all(len(r["output_ids"]) == new for r in results)
    return len(work) * new / seconds


def decode_step_ms(engine: Any, vocab: int, device: str, new: int) -> float:
    prompt = prompts(1, 32, 32, vocab)
    params = {"temperature": 0, "ignore_eos": True}

    def run(n: int) -> float:
        return timed(lambda: engine.generate(prompt, {**params, "max_new_tokens": n}), device)

    run(new + 1)  # warm-up
    one = min(run(1) for _ in range(3))
    many = min(run(new + 1) for _ in range(3))
    return (many - one) / new * 1000


def copy_bandwidth(device: str) -> float:
    """Bytes moved per second (read + written) by a 1 GiB device copy; the best of 5."""
    n = (1 << 30) if device == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(timed(lambda: dst.copy_(src), device) for _ in range(5))
    return 2 * n / best


def weight_bytes(path: Path) -> int:
    """Bytes of every weight as stored (a tied lm_head is stored, and read, once)."""
    from safetensors import safe_open

    size = {"BF16": 2, "F16": 2, "F32": 4}
    total = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensor = st.get_slice(name)
                total += math.prod(tensor.get_shape()) * size[tensor.get_dtype()]
    return total


def baton_runs(path: Path, device: str, smoke: bool, attention: str, vocab: int) -> dict[str, Any]:
    engine = baton_engine(path, device, "float32" if smoke else "bfloat16", smoke, attention)
    out: dict[str, Any] = {"tok_s": {}, "attention": type(engine.runner.attn).__name__,
                           "decode_graphs": engine.runner.graphs is not None}
    try:
        for wname, (n, lo, hi, new) in (SMOKE_WORKLOADS if smoke else WORKLOADS).items():
            out["tok_s"][wname] = baton(engine, prompts(n, lo, hi, vocab), new, device)
            print(f"  baton ({attention}) {wname}: {out['tok_s'][wname]:.0f} tok/s", flush=True)
        out["decode_step_ms"] = decode_step_ms(engine, vocab, device, 8 if smoke else 128)
    finally:
        engine.shutdown()
    return out


def bench_shape(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    device, smoke = ("cpu", True) if args.smoke else ("cuda", False)
    dtype = torch.float32 if smoke else torch.bfloat16
    path = write_model(workdir / name, SHAPES[name], dtype)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    print(f"{name}:", flush=True)
    attentions = ["auto"] if smoke else ["triton", *(["flashinfer"] if has_flashinfer() else [])]
    out: dict[str, Any] = {"baton": {a: baton_runs(path, device, smoke, a, vocab) for a in attentions}}
    out["hf_static"], out["hf_static_by_mode"] = {}, {}
    for wname, (n, lo, hi, new) in (SMOKE_WORKLOADS if smoke else WORKLOADS).items():
        modes = {}
        for mode in ("compiled", "eager"):
            modes[mode] = hf_static(path, prompts(n, lo, hi, vocab), new, dtype, device,
                                    compiled=mode == "compiled")
            if device == "cuda":
                torch.cuda.empty_cache()  # the HF model's memory
        out["hf_static_by_mode"][wname] = modes
        out["hf_static"][wname] = max(modes.values())
        ratios = {a: run["tok_s"][wname] / out["hf_static"][wname] for a, run in out["baton"].items()}
        print(f"  HF static {wname}: {modes['compiled']:.0f} tok/s compiled, {modes['eager']:.0f} "
              "eager; baton / the faster: "
              + ", ".join(f"{r:.1f}x ({a})" for a, r in ratios.items()), flush=True)
    out["weight_bytes"] = weight_bytes(path)
    out["copy_bandwidth_gbs"] = copy_bandwidth(device) / 1e9
    out["weight_read_bound_ms"] = out["weight_bytes"] / (out["copy_bandwidth_gbs"] * 1e9) * 1000
    for a, run in out["baton"].items():
        run["decode_step_over_bound"] = run["decode_step_ms"] / out["weight_read_bound_ms"]
        print(f"  batch-1 decode step ({a}) {run['decode_step_ms']:.3f} ms; weight-read bound "
              f"{out['weight_read_bound_ms']:.3f} ms ({out['weight_bytes'] / 1e9:.2f} GB at "
              f"{out['copy_bandwidth_gbs']:.0f} GB/s): {run['decode_step_over_bound']:.2f}x", flush=True)
    shutil.rmtree(path, ignore_errors=True)
    return out


def has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="135m,1b")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--smoke", action="store_true", help="CPU, a 2-layer shape, tiny workloads")
    args = p.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA device (or --smoke on the CPU)", file=sys.stderr)
        return 2
    shapes = ["smoke"] if args.smoke else args.shapes.split(",")
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu",
        "torch": torch.__version__, "python": platform.python_version(),
        "command": " ".join(["python", "bench/gpu.py", *sys.argv[1:]]), "shapes": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="baton-gpu-bench-") as tmp:
        for name in shapes:
            report["shapes"][name] = bench_shape(name, args, Path(tmp))
            # after each shape: a run cut short by the command's time limit keeps what it has
            (args.out / "gpu.json").write_text(json.dumps(report, indent=2) + "\n")
            print(f"wrote {args.out / 'gpu.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
