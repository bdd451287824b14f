"""Gemma 3 beyond its logits (test_forward_vs_hf.py) and its tokens (test_families.py): each
layer's window and RoPE read from a config as HF transformers reads them, in the form
transformers 5 writes (`layer_types`, `rope_parameters` per layer type) and in the form of the
published checkpoints (`sliding_window_pattern`, `rope_local_base_freq`); the rules shared with
Qwen2 and Mistral; and what the family refuses."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.model_config import ModelConfig
from runtime.models.gemma3 import Gemma3Model, UnsupportedGemmaConfig
from runtime.models.rope import inv_frequencies

SMALL: dict[str, Any] = dict(vocab_size=100, hidden_size=64, intermediate_size=96,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             max_position_embeddings=512)
CONFIGS: dict[str, dict[str, Any]] = {
    # what transformers 5 writes (its own config class's to_dict below)
    "gemma3-layer-types": dict(model_type="gemma3_text", num_hidden_layers=3, sliding_window=16,
                               layer_types=["sliding_attention", "full_attention",
                                            "sliding_attention"]),
    # a published checkpoint's form (gemma-3-1b-it, gemma-3-27b's text config)
    "gemma3-published": dict(model_type="gemma3_text", num_hidden_layers=7, sliding_window=16,
                             sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=1e4,
                             rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "gemma3-default-pattern": dict(model_type="gemma3_text", num_hidden_layers=7, sliding_window=16),
    # Qwen2 before transformers 5: the layers from max_window_layers on slide, when asked to
    "qwen2-window-from-layer-2": dict(model_type="qwen2", num_hidden_layers=4, sliding_window=16,
                                      use_sliding_window=True, max_window_layers=2),
    "qwen2-window-off": dict(model_type="qwen2", num_hidden_layers=2, sliding_window=16,
                             use_sliding_window=False),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_layer_s_window_and_rope_are_hf_s(name: str) -> None:
    import transformers

    raw = dict(SMALL, **CONFIGS[name])
    hf_config = transformers.AutoConfig.for_model(**raw)
    if name == "gemma3-layer-types":
        raw = hf_config.to_dict()  # as transformers 5 saves it: rope_parameters per layer type
    ours = ModelConfig.from_hf_dict(dict(raw, architectures=["X"]))
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).model
    assert ours.sliding_windows == tuple(layer.self_attn.sliding_window for layer in hf.layers)
    assert any(ours.sliding_windows) == (name != "qwen2-window-off")
    if name.startswith("gemma3"):
        full = inv_frequencies(32, ours.rope_theta, ours.rope_scaling)
        local = inv_frequencies(32, ours.local_rope_theta or 0.0, ours.local_rope_scaling)
        torch.testing.assert_close(full, hf.rotary_emb.full_attention_inv_freq)
        torch.testing.assert_close(local, hf.rotary_emb.sliding_attention_inv_freq)
        assert not torch.equal(full, local)
        assert ours.attention_scale == 256**-0.5 and ours.hidden_act == "gelu_pytorch_tanh"


def test_mistral_slides_every_layer_and_a_window_as_long_as_the_context_is_none() -> None:
    import transformers

    for window, want in ((16, 16), (512, None), (None, None)):
        raw = transformers.MistralConfig(**SMALL, num_hidden_layers=2,
                                         sliding_window=window).to_dict()
        assert ModelConfig.from_hf_dict(raw).sliding_windows == (want, want)


def test_what_gemma3_refuses_it_refuses_before_reading_a_weight() -> None:
    raw = dict(SMALL, **CONFIGS["gemma3-layer-types"], architectures=["Gemma3ForCausalLM"])
    config = ModelConfig.from_hf_dict(raw)
    nowhere = Path("/nonexistent")
    capped = dataclasses.replace(config, attn_logit_softcap=50.0)
    with pytest.raises(UnsupportedGemmaConfig, match="attention logit soft-capping"):
        Gemma3Model(capped, nowhere, torch.float32, "cpu")
    with pytest.raises(UnsupportedGemmaConfig, match="hidden_activation 'silu'"):
        Gemma3Model(dataclasses.replace(config, hidden_act="silu"), nowhere, torch.float32, "cpu")
