"""PD with different TP on each side, on a GPU: a prefill over 2 ranks and a decode over 1 (and
the other way round), `baton serve --device cuda` each, over tcp (each rank's share of the KV
heads staged through the host), give HF's greedy tokens. With one GPU both ranks of a server
share it (gloo over CUDA tensors: runtime/scheduler/ranks.py backend_for)."""

from __future__ import annotations

import asyncio
import warnings
from pathlib import Path

import pytest
import torch

from tests.disagg.pd import start_pair
from tests.disagg.test_pd_equality import run_pd
from tests.engine.hf_reference import MAX_NEW, PROMPTS, compare
from tests.gpu.conftest import GPU, hf_greedy_cuda, model_files
from tests.models.checkpoints import SHAPE, write_checkpoint

pytestmark = GPU


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_pd_over_ranks_equals_hf(p_tp: int, d_tp: int, tmp_path: Path) -> None:
    path = write_checkpoint("LlamaConfig", tmp_path / "llama", model_files(),
                            **dict(SHAPE, hidden_size=128, num_attention_heads=8,
                                   num_key_value_heads=2))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    refs = hf_greedy_cuda(path, prompt_ids, torch.float32, MAX_NEW)
    pair = start_pair(tmp_path, "tcp", "--device", "cuda", "--dtype", "float32",
                      "--attention-backend", "triton", model=str(path),
                      prefill_extra=("--tp", str(p_tp)), decode_extra=("--tp", str(d_tp)))
    try:
        notes = [compare(ours, ref) for ours, ref in
                 zip(asyncio.run(run_pd(pair, prompt_ids)), refs, strict=True)]
        for note in filter(None, notes):
            warnings.warn(f"P tp={p_tp}, D tp={d_tp}: {note}", stacklevel=1)
        assert sum(n is not None for n in notes) <= 1, notes
    finally:
        pair.stop()
