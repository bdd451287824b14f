"""On a GPU, tensor parallelism gives HF's greedy tokens: a tiny Llama with 8 heads and 2 KV heads
over 2 ranks, float32 and bf16, triton attention, overlap on. With one GPU both ranks share it
and the group is gloo over CUDA tensors (nccl refuses two ranks on one device); with two or
more each rank has its own GPU and the group is nccl (runtime/scheduler/ranks.py backend_for).
Decode graphs: off with gloo (host collectives cannot be captured); with nccl each rank captures
its all-reduces and all-gather into its graphs, and the tokens must not change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.hf_reference import PROMPTS, TP_LOGPROB_ULPS
from tests.gpu.conftest import GPU, hf_greedy_cuda, model_files
from tests.gpu.test_gpu_engine import run
from tests.models.checkpoints import SHAPE, write_checkpoint

pytestmark = GPU


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp2_greedy_matches_hf(dtype: str, tmp_path: Path) -> None:
    path = write_checkpoint("LlamaConfig", tmp_path / "llama", model_files(), getattr(torch, dtype),
                            **dict(SHAPE, hidden_size=128, num_attention_heads=8,
                                   num_key_value_heads=2))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ids = [tok.encode(p) for p in PROMPTS]
    n = 32 if dtype == "float32" else 16
    refs = hf_greedy_cuda(path, ids, getattr(torch, dtype), n)
    # tokens and logprobs against HF's; in bf16 (each rank's partial sums rounded before the
    # all-reduce: hf_reference.TP_LOGPROB_ULPS) any prompt may end at a reported near-tie
    engine = run(path, ids, refs, n, TP_LOGPROB_ULPS, dtype=dtype, attention_backend="triton",
                 tp=2, max_total_tokens=8192)
    if torch.cuda.device_count() >= 2:  # nccl: the decode steps replay graphs
        assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    else:
        assert engine.runner.graphs is None
