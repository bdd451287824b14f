"""On a GPU: greedy output equals HF transformers' token for token (float32; bf16 for the first
16 tokens), with each attention backend, with and without decode graphs, overlap on; the step
loop reads nothing back from the device but the sampled tokens; the KV pool sizes from memory."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime import Engine
from tests.engine.hf_reference import LOGPROB_ULPS, PROMPTS, Reference, compare
from tests.gpu.conftest import GPU, hf_greedy_cuda

pytestmark = GPU

MAX_NEW = 32


@pytest.fixture(scope="module")
def prompt_ids(gpu_model: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gpu_model)
    return [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def refs_fp32(gpu_model: Path, prompt_ids: list[list[int]]) -> list[Reference]:
    return hf_greedy_cuda(gpu_model, prompt_ids, torch.float32, MAX_NEW)


def run(model: Path, prompt_ids: list[list[int]], refs: list[Reference], n: int,
        ulps: int = LOGPROB_ULPS, **args: Any) -> Engine:
    """Tokens and their logprobs against HF's (hf_reference.compare). The model's weights are
    random, so its logits are flat: in bf16 HF against itself (another attention kernel) already
    flips greedy at 1-ulp gaps on 2 of the 8 prompts, so there every prompt may end at a near-tie,
    each reported; in float32 at most one may."""
    engine = Engine(model=str(model), device="cuda", enable_overlap=True, **args)
    try:
        results = engine.generate(prompt_ids, {"temperature": 0, "max_new_tokens": n},
                                  return_logprob=True)
        notes = []
        for r, ref in zip(results, refs, strict=True):
            logprobs = [lp for lp, _ in r["meta_info"]["output_token_logprobs"]]
            notes.append(compare(r["output_ids"][:n], ref.head(n), logprobs[:n], ulps))
        for note in filter(None, notes):
            warnings.warn(f"{args}: {note}", stacklevel=1)
        if refs[0].dtype == torch.float32:
            assert sum(x is not None for x in notes) <= 1, notes
        assert engine.runner.kv.is_all_free()
    finally:
        engine.shutdown()
    return engine


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("attention", ["triton", "torch"])
def test_float32_greedy_matches_hf(gpu_model: Path, prompt_ids: list[list[int]],
                                   refs_fp32: list[Reference], attention: str, graphs: bool) -> None:
    engine = run(gpu_model, prompt_ids, refs_fp32, MAX_NEW, dtype="float32",
                 attention_backend=attention, disable_cuda_graph=not graphs)
    captured = engine.runner.graphs is not None
    assert captured == (graphs and attention == "triton")  # torch attention cannot be captured


@pytest.mark.parametrize(("attention", "graphs"), [("triton", True), ("torch", False),
                                                  ("flashinfer", True), ("flashinfer", False)],
                         ids=["triton", "torch", "flashinfer-graphs", "flashinfer-eager"])
def test_bfloat16_first_16_tokens_match_hf(gpu_model: Path, prompt_ids: list[list[int]],
                                           tmp_path: Path, attention: str, graphs: bool) -> None:
    from tests.gpu.conftest import random_llama

    if attention == "flashinfer":
        pytest.importorskip("flashinfer")  # carried on its own (62 MB): gpu/prepare.sh notes

    model = random_llama(tmp_path / "bf16", torch.bfloat16)
    refs = hf_greedy_cuda(model, prompt_ids, torch.bfloat16, 16)
    engine = run(model, prompt_ids, refs, 16, dtype="bfloat16", attention_backend=attention,
                 disable_cuda_graph=not graphs)
    captured = engine.runner.graphs
    assert (captured is not None) == graphs
    assert captured is None or captured.replays > 0


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_the_step_loop_never_syncs(gpu_model: Path, prompt_ids: list[list[int]], overlap: bool) -> None:
    """CUDA's own sync detector (process-wide: the overlap thread too) for a whole generation
    with sampling, penalties, a logit bias and logprobs: only the event wait for each step's
    results may block. Decode graphs are replayed, not just captured."""
    engine = Engine(model=str(gpu_model), device="cuda", enable_overlap=overlap,
                    attention_backend="triton")
    try:
        engine.generate(prompt_ids[:2], {"temperature": 0, "max_new_tokens": 4})  # warm-up
        torch.cuda.set_sync_debug_mode("error")
        try:
            engine.generate(prompt_ids, {"temperature": 0.7, "top_k": 20, "top_p": 0.9,
                                         "repetition_penalty": 1.1, "logit_bias": {"42": 2.0},
                                         "max_new_tokens": 8},
                            return_logprob=True, top_logprobs_num=3)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graphs = engine.runner.graphs
        assert graphs is not None and graphs.replays > 0
    finally:
        engine.shutdown()


def test_kv_pool_from_mem_fraction_and_a_clear_out_of_memory(gpu_model: Path) -> None:
    from runtime.engine.memory import NoRoomForKV

    total = torch.cuda.mem_get_info()[1]
    sizes = []
    for _ in range(2):  # the second finds the first one's memory cached by torch, not in use
        engine = Engine(model=str(gpu_model), device="cuda", mem_fraction_static=0.5)
        try:
            sizes.append(engine.runner.pool.num_pages * engine.runner.pool.page_bytes)
        finally:
            engine.shutdown()
        del engine
        gc.collect()
    assert 0.2 * total < sizes[0] < 0.5 * total and sizes[1] > 0.95 * sizes[0], sizes
    with pytest.raises(NoRoomForKV, match="lower --mem-fraction-static or --max-total-tokens"):
        Engine(model=str(gpu_model), device="cuda", max_total_tokens=10**10)
