"""On a GPU, an FP8 checkpoint (block-wise and per-channel, runtime/models/fp8.py) loads onto CUDA
and generates exactly what the same model with its weights dequantized by the test does there
(tokens and logprobs), which equals HF's on CUDA. The CPU's version: tests/models/test_fp8_checkpoints.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime import Engine
from tests.engine.hf_reference import PROMPTS, compare
from tests.gpu.conftest import GPU, hf_greedy_cuda, model_files
from tests.models.checkpoints import SHAPE, write_checkpoint
from tests.models.test_fp8_checkpoints import write_fp8

pytestmark = GPU


@pytest.mark.parametrize("fmt", ["block", "channel"])
def test_an_fp8_checkpoint_on_cuda_equals_its_dequantized_weights(fmt: str, tmp_path: Path) -> None:
    src = write_checkpoint("LlamaConfig", tmp_path / "src", model_files(),
                           **dict(SHAPE, hidden_size=192, intermediate_size=320,
                                  num_attention_heads=6, num_key_value_heads=2))
    write_fp8(src, fmt, tmp_path / "fp8", tmp_path / "plain")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    ids = [tok.encode(p) for p in PROMPTS[:4]]
    outs = {}
    for name in ("fp8", "plain"):
        engine = Engine(model=str(tmp_path / name), device="cuda", dtype="float32",
                        attention_backend="triton", max_total_tokens=4096)
        try:
            outs[name] = engine.generate(ids, {"temperature": 0, "max_new_tokens": 16},
                                         return_logprob=True)
        finally:
            engine.shutdown()
    for a, b in zip(outs["fp8"], outs["plain"], strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    refs = hf_greedy_cuda(tmp_path / "plain", ids, torch.float32, 16)
    notes = [compare(o["output_ids"], r) for o, r in zip(outs["plain"], refs, strict=True)]
    assert sum(note is not None for note in notes) <= 1, notes
