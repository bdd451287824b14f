"""On a GPU, every family beyond Llama (tests/models/checkpoints.py: Qwen3, Qwen3-MoE, Mixtral,
Qwen2-MoE) gives HF's greedy tokens: float32 (MoE experts one by one, so no decode graphs) and
bf16 (MoE experts through torch._grouped_mm, decode graphs captured and replayed), triton
attention, overlap on; then the step loop with a grouped MoE makes no host sync."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime import Engine
from tests.engine.hf_reference import PROMPTS
from tests.gpu.conftest import GPU, hf_greedy_cuda, model_files
from tests.gpu.test_gpu_engine import run
from tests.models.checkpoints import FAMILIES, write_family

pytestmark = GPU

MOE = ("qwen3-moe", "mixtral", "qwen2-moe")


def _prompts(path: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [tok.encode(p) for p in PROMPTS]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_greedy_matches_hf(name: str, dtype: str, tmp_path: Path) -> None:
    # (Qwen3's head_dim is 24: the triton kernels run it padded to 32 columns)
    path = write_family(name, tmp_path / name, model_files(), getattr(torch, dtype))
    ids = _prompts(path)
    n = 32 if dtype == "float32" else 16
    refs = hf_greedy_cuda(path, ids, getattr(torch, dtype), n)
    engine = run(path, ids, refs, n, dtype=dtype, attention_backend="triton")
    graphs = engine.runner.graphs
    grouped = dtype == "bfloat16"
    assert (graphs is not None) == (grouped or name not in MOE), (name, dtype)
    assert graphs is None or graphs.replays > 0
    if name in MOE:
        moe = engine.runner.model.layers[-1].mlp
        assert getattr(moe, "routed", moe).grouped == grouped


def test_a_grouped_moe_step_loop_never_syncs(tmp_path: Path) -> None:
    path = write_family("qwen3-moe", tmp_path / "moe", model_files(), torch.bfloat16)
    ids = _prompts(path)
    engine = Engine(model=str(path), device="cuda", dtype="bfloat16", attention_backend="triton")
    try:
        engine.generate(ids[:2], {"temperature": 0, "max_new_tokens": 4})  # warm-up, capture
        torch.cuda.set_sync_debug_mode("error")
        try:
            engine.generate(ids, {"temperature": 0, "max_new_tokens": 8})
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    finally:
        engine.shutdown()
