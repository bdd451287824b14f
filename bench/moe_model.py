"""A Qwen3-MoE-shaped checkpoint with random weights, for bench/throughput.py --model moe.

SmolLM2-135M's width and tokenizer (hidden 576, 9 heads of 64, 3 KV heads, vocab 49152) with
12 layers whose MLP is 8 experts of 384, top-2, renormalized: about 330M parameters, ~80M of them
active per token. Written once by HF transformers from its own config class into
$BATON_CACHE/bench/qwen3-moe-random (or ~/.cache/baton/...); the weights are random (seed 0)
with routers scaled so that tokens spread over the experts. The numbers measure speed, not
text quality.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

SHAPE = dict(hidden_size=576, num_hidden_layers=12, num_attention_heads=9, num_key_value_heads=3,
             head_dim=64, intermediate_size=1536, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=384, norm_topk_prob=True, max_position_embeddings=2048,
             tie_word_embeddings=True)


def moe_model() -> Path:
    import torch
    import transformers

    from runtime.model_store import resolve_model_path

    base = Path(os.environ.get("BATON_CACHE", Path.home() / ".cache" / "baton"))
    dest = base / "bench" / "qwen3-moe-random"
    if (dest / "config.json").exists():
        return dest
    tokenizer = resolve_model_path("builtin:smollm2-135m")
    vocab = transformers.AutoConfig.from_pretrained(tokenizer).vocab_size
    config = transformers.Qwen3MoeConfig(vocab_size=vocab, bos_token_id=1, eos_token_id=2,
                                         **SHAPE)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)  # routers: tokens spread over the experts
    tmp = dest.with_name(dest.name + ".partial")
    model.save_pretrained(tmp)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer / f).exists():
            shutil.copy(tokenizer / f, tmp / f)
    tmp.rename(dest)
    return dest
