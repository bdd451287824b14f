"""The four systems `bench/throughput.py` times, one function each.

Every runner takes the same prompts (token-id lists) and `max_new_tokens`, decodes greedily,
produces exactly `max_new_tokens` tokens per prompt (EOS cannot end a request early), and returns
a `RunResult`: wall seconds of the timed region and the generated ids per prompt in input order.
Model loading and warm-up are never inside the timed region.

The bare HF forward bound (`run_forward_bound`) is defined as the sum of the wall times of the
HF model forwards that the workload needs at minimum, and nothing else:

* prefill: the cheaper of two ways HF can run it, both timed: one unpadded forward per prompt
  (batch 1, no padding waste, as a ragged-batch engine would), or all prompts as one left-padded
  batch (better matmul shapes for short prompts, padding waste for long ones);
  `logits_to_keep=1` in both;
* decode: all prompts as ONE batch (the composition baton runs: every request decodes together)
  over the `DynamicCache` the padded prefill built: `max_new_tokens - 1` forwards of shape
  `[N, 1]` with `logits_to_keep=1`.

Not counted: sampling (the argmax that feeds the next step), scheduling, padding/mask building,
tokenization, Python between forwards. The decode cache is padded to the longest prompt, so its
attention reads some padding (a few % of a decode step for the 80-260-token workload, ~nothing for
32-64); HF's forward also pays `DynamicCache`'s per-step concatenation, which is part of HF's
forward. A system that is as fast as HF's own forward kernels scores 1.0 against this bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Log = Callable[[str], None]


@dataclass
class RunResult:
    seconds: float
    outputs: list[list[int]]  # generated ids per prompt, input order
    extra: dict[str, Any] = field(default_factory=dict)


def check_lengths(name: str, outputs: list[list[int]], max_new_tokens: int) -> None:
    """Every system must generate exactly the same tokens; a short output would flatter it."""
    bad = [i for i, out in enumerate(outputs) if len(out) != max_new_tokens]
    if bad:
        lens = sorted({len(outputs[i]) for i in bad})
        raise RuntimeError(f"{name}: {len(bad)} outputs not {max_new_tokens} tokens long: {lens}")


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [N, width]
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


@torch.inference_mode()
def run_hf_static(
    model: Any, prompts: list[list[int]], max_new_tokens: int, pad_id: int, log: Log,
    batch_size: int = 8,
) -> RunResult:
    """`model.generate` on consecutive batches of `batch_size` (input order), left padding."""
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        ids, mask = left_pad(prompts[first : first + batch_size], pad_id)
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad_id,
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        )
        outputs += out[:, ids.shape[1] :].tolist()
        done = min(first + batch_size, len(prompts))
        log(f"hf_static: {done}/{len(prompts)} prompts, {time.perf_counter() - start:.1f} s")
    seconds = time.perf_counter() - start
    check_lengths("hf_static", outputs, max_new_tokens)
    return RunResult(seconds, outputs, {"batch_size": batch_size})


# generate_batch's step shape on this 2-core CPU. With SDPA (no flash-attn on CPU) every query of
# a step attends over the whole step's concatenated KV under a mask, so attention grows with
# requests-per-step squared: small steps win. Measured on the full workloads (2026-11-22, idle,
# one run each; runs differ by up to ~10%):
#   max_batch_tokens/max_requests  2048/256 (= baton's)  256/32  512/16  512/32
#   decode-heavy  tok/s                     95.9          104.3   110.5    -
#   prefill-heavy tok/s                     68.1           64.7    74.2   58.2
GB_TUNED = {"max_batch_tokens": 512, "max_requests": 16}


def generate_batch_config(max_batch_tokens: int, max_requests: int, kv_tokens: int) -> Any:
    """generate_batch's scheduler limits; the KV capacity is always baton's."""
    from transformers import ContinuousBatchingConfig

    page_size = 32
    return ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=kv_tokens // page_size,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests,
        allow_block_sharing=False,  # prompts share no prefix; baton has no prefix cache either
    )


@torch.inference_mode()
def run_generate_batch(
    model: Any, prompts: list[list[int]], max_new_tokens: int, cb_config: Any, log: Log
) -> RunResult:
    """transformers' continuous batching (`generate_batch`); EOS disabled so none stops early."""
    from transformers import GenerationConfig

    # eos_token_id=-1 is generate_batch's own "disabled" value (it substitutes it for None).
    gen = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    start = time.perf_counter()
    results = model.generate_batch(
        [list(p) for p in prompts], generation_config=gen, continuous_batching_config=cb_config,
        warmup=False,
    )
    seconds = time.perf_counter() - start
    # generate_batch logs failures instead of raising; a missing or failed request is an error.
    ordered = list(results.values())
    errors = [r.error for r in ordered if r.error is not None]
    if len(ordered) != len(prompts) or errors:
        raise RuntimeError(
            f"generate_batch returned {len(ordered)}/{len(prompts)} results; errors: {errors[:3]}"
        )
    outputs = [list(r.generated_tokens) for r in ordered]
    check_lengths("generate_batch", outputs, max_new_tokens)
    log(f"generate_batch: {len(prompts)} prompts, {seconds:.1f} s")
    extra = {
        "attn_implementation": model.config._attn_implementation,
        "max_batch_tokens": cb_config.max_batch_tokens,
        "max_requests_per_batch": cb_config.max_requests_per_batch,
        "page_size": cb_config.page_size,
        "num_blocks": cb_config.num_blocks,
    }
    return RunResult(seconds, outputs, extra)


def _timed_forward(model: Any, **kwargs: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = model(**kwargs, logits_to_keep=1, use_cache=True)
    return out, time.perf_counter() - start


@torch.inference_mode()
def run_forward_bound(
    model: Any, prompts: list[list[int]], max_new_tokens: int, pad_id: int, log: Log
) -> RunResult:
    """Sum of HF forward times for the workload (see the module docstring for the definition)."""
    from transformers import DynamicCache

    prefill_s = 0.0
    for prompt in prompts:
        _, dt = _timed_forward(model, input_ids=torch.tensor([prompt], dtype=torch.long))
        prefill_s += dt
    log(f"hf_forward_bound: {len(prompts)} per-prompt prefills, {prefill_s:.1f} s")

    ids, mask = left_pad(prompts, pad_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [N, width]
    cache = DynamicCache(config=model.config)
    out, padded_s = _timed_forward(
        model, input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache
    )
    tokens = out.logits[:, -1].argmax(-1, keepdim=True)  # [N, 1]
    generated = [tokens]
    pos = positions[:, -1:] + 1  # [N, 1]
    decode_s = 0.0
    for step in range(max_new_tokens - 1):
        mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
        out, dt = _timed_forward(
            model, input_ids=tokens, attention_mask=mask, position_ids=pos, past_key_values=cache
        )
        decode_s += dt
        tokens = out.logits[:, -1].argmax(-1, keepdim=True)
        generated.append(tokens)
        pos = pos + 1
        if (step + 1) % 64 == 0:
            log(f"hf_forward_bound: decode step {step + 1}/{max_new_tokens - 1}, {decode_s:.1f} s")
    outputs = torch.cat(generated, dim=1).tolist()
    check_lengths("hf_forward_bound", outputs, max_new_tokens)
    extra = {
        "prefill_per_prompt_s": prefill_s,
        "prefill_padded_batch_s": padded_s,
        "prefill_s": min(prefill_s, padded_s),
        "decode_s": decode_s,
        "decode_batch": len(prompts),
        "decode_steps": max_new_tokens - 1,
    }
    return RunResult(min(prefill_s, padded_s) + decode_s, outputs, extra)


def run_baton(engine: Any, prompts: list[list[int]], max_new_tokens: int, log: Log) -> RunResult:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    outputs = [list(r["output_ids"]) for r in results]
    check_lengths("baton", outputs, max_new_tokens)
    log(f"baton: {len(prompts)} prompts, {seconds:.1f} s")
    return RunResult(seconds, outputs)
