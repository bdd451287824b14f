"""Disaggregation on a GPU: a prefill and a decode `baton serve --device cuda` over the tcp
transfer (device pages staged through the host) give the colocated engine's greedy tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from runtime import Engine
from tests.disagg.pd import start_pair
from tests.disagg.test_pd_equality import run_pd
from tests.engine.hf_reference import MAX_NEW, PROMPTS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_pd_over_tcp_equals_colocated(gpu_model: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gpu_model)
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    engine = Engine(model=str(gpu_model), device="cuda", dtype="float32")
    try:
        colocated = [r["output_ids"] for r in engine.generate(
            prompt_ids, {"temperature": 0, "max_new_tokens": MAX_NEW})]
    finally:
        engine.shutdown()
    pair = start_pair(tmp_path, "tcp", "--device", "cuda", "--dtype", "float32", model=str(gpu_model))
    try:
        assert asyncio.run(run_pd(pair, prompt_ids)) == colocated
    finally:
        pair.stop()
