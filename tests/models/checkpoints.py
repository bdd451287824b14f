"""Tiny checkpoints of every family beyond Llama, written by HF transformers from the family's own
config class: 2 layers, sharp random weights so greedy has margins, a given tokenizer. The family
tests use them on the CPU, tests/gpu on a GPU. Gemma 3's sliding layer has a window of 8, shorter
than every prompt with its output, beside a global layer."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

SHAPE: dict[str, Any] = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=512, initializer_range=0.3)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=True)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=48, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2-moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=48,
                                         shared_expert_intermediate_size=64)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention", "full_attention"])),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def write_family(name: str, dest: Path, tokenizer: Path, dtype: torch.dtype = torch.float32,
                 **overrides: Any) -> Path:
    """FAMILIES[name] (with `overrides` of its config) with random weights (seed 0) in `dest`,
    with `tokenizer`'s vocabulary and files. MoE routers get a wide spread, so each token's
    experts are decisive picks."""
    cls, extra = FAMILIES[name]
    return write_checkpoint(cls, dest, tokenizer, dtype, **{**SHAPE, **extra, **overrides})


def write_checkpoint(cls: str, dest: Path, tokenizer: Path, dtype: torch.dtype = torch.float32,
                     **config: Any) -> Path:
    """A random checkpoint (seed 0) of transformers' config class `cls` with `config`, and
    `tokenizer`'s vocabulary (unless `config` sets vocab_size) and files, in `dest`."""
    import transformers

    vocab = config.pop("vocab_size", None) or transformers.AutoConfig.from_pretrained(
        tokenizer).vocab_size
    hf_config = getattr(transformers, cls)(vocab_size=vocab, bos_token_id=1, eos_token_id=2,
                                           **config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if cls.startswith("Gemma") and pname.endswith("norm.weight"):
                p.normal_(0, 0.3)  # its norms scale by 1 + w: random, so a lost 1 shows
            elif pname.endswith("gate.weight"):  # MoE routers: decisive picks
                p.normal_(0, 1.0)
            elif pname.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1, 0.3)
    model.to(dtype).save_pretrained(dest)
    for f in TOKENIZER_FILES:
        if (tokenizer / f).exists():
            shutil.copy(tokenizer / f, dest / f)
    return dest
