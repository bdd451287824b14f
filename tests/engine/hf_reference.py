"""HF transformers greedy reference, with near-tie detection for honest token comparisons."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

NEAR_TIE = 1e-3  # HF top-2 logit gap under which float noise may legitimately flip greedy

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
            top2 = [step[0].float().topk(2).values for step in out.logits]
            refs.append(
                Reference(
                    ids=out.sequences[0, len(ids) :].tolist(),
                    gaps=[float(t[0] - t[1]) for t in top2],
                )
            )
    return refs


def compare(ours: list[int], ref: Reference) -> str | None:
    """None if equal. A divergence at a genuine near-tie returns a note; any other raises."""
    for i, (a, b) in enumerate(zip(ours, ref.ids, strict=False)):
        if a != b:
            if ref.gaps[i] < NEAR_TIE:
                return f"near-tie at step {i}: ours {a}, HF {b}, HF top-2 gap {ref.gaps[i]:.2e}"
            raise AssertionError(
                f"token {i} differs: ours {a}, HF {b} (HF top-2 gap {ref.gaps[i]:.3f})\n"
                f"ours: {ours}\nHF:   {ref.ids}"
            )
    if len(ours) != len(ref.ids):
        raise AssertionError(f"length differs: ours {len(ours)}, HF {len(ref.ids)}")
    return None
