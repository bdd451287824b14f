"""HF transformers greedy reference, with near-tie detection for honest token comparisons."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

NEAR_TIE = 1e-3  # float32: HF top-2 logit gap under which float noise may legitimately flip greedy
# bfloat16/float16 logits keep 8/11 significant bits, so there a near-tie is counted in units in
# the last place (ulps) of HF's top logit. HF against itself with only its attention kernel
# changed (eager vs sdpa, bf16, the builtin architecture with random weights, on the CPU) moves
# logits by up to 4 ulps and flips greedy at gaps of 0 and 1 ulp (2 of PROMPTS within 16 tokens).
NEAR_TIE_ULPS = 4
# Up to the first divergence our logprob of each token must be this close to HF's: 1e-3 in
# float32, 4 ulps of HF's top logit in bf16/fp16. The same bf16 experiment moves them by 1 ulp
# (0.016) at most, and baton bf16 on the CPU differs from HF by 1.1 ulps on the real model (whose
# logits reach 16-32, where an ulp is 0.125); hiding the first key from attention (a lost KV
# page) moves them by 0.6-2.4 on the random model, 40-150 ulps.
LOGPROB_TOL = 1e-3
LOGPROB_ULPS = 4
# Tensor parallelism in bf16 rounds each rank's row-parallel partial sum (o and down) to bf16
# before the all-reduce, where one rank rounds the whole sum once: with 2 ranks the tests' tiny
# Llama's logprobs moved 4.05 ulps from HF's on the CPU (tp 1: 2.49) and 8 on an H200, with
# greedy flips only at gaps of 0-1 ulp. A lost KV page moves them 40-150 ulps.
TP_LOGPROB_ULPS = 12

# The prompts every token-equality test uses (engine, PD pair, PD through the router), and how
# many tokens each generates: their HF reference is computed once per session (tests/conftest.py).
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Hello, my name is",
    "Once upon a time, in a land far away, there lived a",
    "List three colors:",
    "Water boils at a temperature of",
    "Explain why the sky is blue. " * 6,
    "In 1492, Columbus sailed across the ocean. " * 12,
]
MAX_NEW = 32


@dataclass
class Reference:
    ids: list[int]
    gaps: list[float]  # HF's top-1 minus top-2 logit at each generated step
    tops: list[float]  # HF's top logit at each step
    logprobs: list[float]  # HF's log-softmax of its token at each step
    dtype: torch.dtype = torch.float32

    def head(self, n: int) -> Reference:
        return Reference(self.ids[:n], self.gaps[:n], self.tops[:n], self.logprobs[:n], self.dtype)

    def ulp(self, i: int) -> float:
        """The spacing of HF's dtype at its top logit of step i."""
        return torch.finfo(self.dtype).eps * 2.0 ** math.floor(math.log2(abs(self.tops[i]) or 1.0))

    def near_tie(self, i: int) -> bool:
        if self.dtype == torch.float32:
            return self.gaps[i] < NEAR_TIE
        return self.gaps[i] <= NEAR_TIE_ULPS * self.ulp(i)

    def logprob_tolerance(self, i: int, ulps: int = LOGPROB_ULPS) -> float:
        return LOGPROB_TOL if self.dtype == torch.float32 else ulps * self.ulp(i)


def hf_greedy(
    path: Path, prompts: list[list[int]], max_new_tokens: int,
    dtype: torch.dtype = torch.float32, device: str = "cpu",
) -> list[Reference]:
    """Greedy generate one prompt at a time (no padding), recording top-2 gaps."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids], device=device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=2,
            )
            chosen = out.sequences[0, len(ids) :].tolist()
            logits = [step[0].float() for step in out.logits]
            top2 = [x.topk(2).values for x in logits]
            refs.append(
                Reference(
                    ids=chosen,
                    gaps=[float(t[0] - t[1]) for t in top2],
                    tops=[float(t[0]) for t in top2],
                    logprobs=[float(x.log_softmax(-1)[c]) for x, c in zip(logits, chosen, strict=True)],
                    dtype=dtype,
                )
            )
    return refs


def compare(ours: list[int], ref: Reference, logprobs: list[float] | None = None,
            ulps: int = LOGPROB_ULPS) -> str | None:
    """None if equal. A divergence at a genuine near-tie returns a note; any other raises. With
    `logprobs` (ours, of our tokens), each must be within Reference.logprob_tolerance of HF's up
    to the first divergence: on a model whose logits are flat (random weights) that, not the tokens, is what
    shows a wrong attention."""
    for i, (a, b) in enumerate(zip(ours, ref.ids, strict=False)):
        if a != b:
            if ref.near_tie(i):
                return f"near-tie at step {i}: ours {a}, HF {b}, HF top-2 gap {ref.gaps[i]:.2e}"
            raise AssertionError(
                f"token {i} differs: ours {a}, HF {b} (HF top-2 gap {ref.gaps[i]:.3f})\n"
                f"ours: {ours}\nHF:   {ref.ids}"
            )
        if logprobs is not None and abs(logprobs[i] - ref.logprobs[i]) > ref.logprob_tolerance(i, ulps):
            raise AssertionError(f"step {i} (token {a}): logprob ours {logprobs[i]:.4f}, "
                                 f"HF {ref.logprobs[i]:.4f}")
    if len(ours) != len(ref.ids):
        raise AssertionError(f"length differs: ours {len(ours)}, HF {len(ref.ids)}")
    return None
