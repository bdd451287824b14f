"""Tensor parallelism in the engine (runtime/models/parallel.py, runtime/scheduler/ranks.py):
real follower processes over gloo, each with its part of the weights and of the KV pool, give
HF transformers' greedy tokens and logprobs (the single-rank engine's, which equal HF's), cold
and from the prefix cache, in lockstep and with overlap. Covered: KV heads copied on several
ranks (fewer KV heads than ranks), a vocabulary the ranks do not split evenly, Qwen2's q/k/v
biases, untied and tied embeddings, Qwen3's q/k norms, TP-MoE (experts split on their
intermediate size), Gemma 3 (its sliding-window layer on every rank), and the real model over 3
ranks. A split that cannot work is refused before
any process starts, naming the counts."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from runtime import Engine
from runtime.model_config import ModelConfig
from runtime.models.parallel import TensorParallel, TPConfigError
from tests.engine.hf_reference import (
    LOGPROB_ULPS,
    MAX_NEW,
    PROMPTS,
    TP_LOGPROB_ULPS,
    Reference,
    compare,
    hf_greedy,
)
from tests.models.checkpoints import FAMILIES, SHAPE, write_checkpoint, write_family

pytestmark = pytest.mark.timeout(300)

# (checkpoint, ranks, engine options): what each case exercises is in its name
LLAMA_8_2 = dict(SHAPE, hidden_size=128, num_attention_heads=8, num_key_value_heads=2)
CASES: dict[str, tuple[str, dict[str, Any], int, dict[str, Any]]] = {
    "llama-8h-2kv-tp2": ("LlamaConfig", LLAMA_8_2, 2, {}),
    "llama-8h-2kv-tp4-kv-copied-uneven-vocab-overlap": (
        "LlamaConfig", dict(LLAMA_8_2, vocab_size=49155), 4, {"enable_overlap": True}),
    "qwen2-biases-untied": ("Qwen2Config", dict(SHAPE, tie_word_embeddings=False), 2, {}),
    "qwen3-moe-tp-moe": ("qwen3-moe", {}, 2, {}),
    # (1 + w) norms, GeGLU split on its intermediate size, a sliding-window layer (8) per rank
    "gemma3-sliding-tp2": ("gemma3", {}, 2, {}),
}


def _prompts(path: Path) -> list[list[int]]:
    """Two short prompts and two long ones (the long ones fill pages the cache keeps)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [tok.encode(PROMPTS[i]) for i in (0, 1, 6, 7)]


def _run(engine: Engine, ids: list[list[int]], refs: list[Reference], what: str,
         max_new: int, ulps: int = LOGPROB_ULPS, near_ties: int = 1) -> int:
    """Greedy with logprobs, checked against `refs` (at most `near_ties` prompts may end at a
    genuine near-tie, reported); returns the prompt tokens found cached."""
    results = engine.generate(ids, {"temperature": 0, "max_new_tokens": max_new},
                              return_logprob=True)
    notes = [compare(r["output_ids"], ref, [lp for lp, _ in r["meta_info"]["output_token_logprobs"]],
                     ulps) for r, ref in zip(results, refs, strict=True)]
    for note in filter(None, notes):
        warnings.warn(f"{what}: {note}", stacklevel=2)  # a genuine near-tie, reported
    assert sum(n is not None for n in notes) <= near_ties, notes
    return sum(r["meta_info"]["cached_tokens"] for r in results)


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp_equals_hf_cold_and_cached(case: str, model_path: Path, tmp_path: Path) -> None:
    cls, config, tp, options = CASES[case]
    path = (write_family(cls, tmp_path / "ckpt", model_path) if cls in FAMILIES
            else write_checkpoint(cls, tmp_path / "ckpt", model_path, **config))
    ids = _prompts(path)
    refs = [r.head(16) for r in hf_greedy(path, ids, 16)]
    engine = Engine(model=str(path), max_total_tokens=4096, tp=tp, **options)
    try:
        assert engine.ranks is not None and len(engine.ranks.procs) == tp - 1
        assert engine.runner.tp == TensorParallel(0, tp)
        assert _run(engine, ids, refs, f"{case} cold", 16) == 0
        assert _run(engine, ids, refs, f"{case} cached", 16) > 0
        assert engine.runner.kv.is_all_free(), "a page is held after every request ended"
        procs = list(engine.ranks.procs)
    finally:
        engine.shutdown()
    assert all(p.poll() is not None for p in procs), "a follower outlived its engine"


def test_bf16_over_two_ranks_stays_within_its_measured_noise(model_path: Path,
                                                            tmp_path: Path) -> None:
    """bf16: each rank rounds its partial sums before the all-reduce, so logprobs move from HF's
    by more than one rank's (hf_reference.TP_LOGPROB_ULPS) and greedy may flip at a near-tie on
    any prompt (reported); a lost page or a wrong head range moves them by 40 ulps or more."""
    import torch

    path = write_checkpoint("LlamaConfig", tmp_path / "ckpt", model_path, torch.bfloat16, **LLAMA_8_2)
    ids = _prompts(path)
    refs = [r.head(16) for r in hf_greedy(path, ids, 16, torch.bfloat16)]
    engine = Engine(model=str(path), max_total_tokens=4096, tp=2, dtype="bfloat16")
    try:
        _run(engine, ids, refs, "bf16 tp=2", 16, TP_LOGPROB_ULPS, near_ties=len(ids))
    finally:
        engine.shutdown()


def test_the_real_model_over_three_ranks(model_path: Path, prompt_ids: list[list[int]],
                                         hf_refs: list[Reference]) -> None:
    """SmolLM2-135M: 9 heads and 3 KV heads, one KV head per rank."""
    engine = Engine(model=str(model_path), max_total_tokens=4096, tp=3)
    try:
        assert engine.runner.model.num_kv_heads == 1
        _run(engine, prompt_ids[:3], [r.head(MAX_NEW) for r in hf_refs[:3]], "smollm2 tp=3",
             MAX_NEW)
    finally:
        engine.shutdown()


def test_a_split_that_cannot_work_is_refused_before_anything_starts(model_path: Path) -> None:
    with pytest.raises(TPConfigError, match=r"--tp 2 does not divide the model's 9 attention "
                                            r"heads or 3 KV heads"):
        Engine(model=str(model_path), tp=2)


@pytest.mark.parametrize(("heads", "kv", "inter", "tp", "problem"), [
    (9, 3, 1536, 2, "9 attention heads or 3 KV heads (nor does 3 divide 2)"),
    (8, 2, 96, 4, None),  # each KV head copied on 2 ranks
    (8, 4, 96, 8, None),
    (8, 6, 96, 4, "6 KV heads (nor does 6 divide 4)"),
    (8, 8, 100, 8, "an intermediate size of 100"),
])
def test_which_splits_are_refused(heads: int, kv: int, inter: int, tp: int,
                                  problem: str | None) -> None:
    config = ModelConfig.from_hf_dict({
        "vocab_size": 100, "hidden_size": heads * 16, "intermediate_size": inter,
        "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv})
    if problem is None:
        TensorParallel(0, tp).check(config)
        return
    with pytest.raises(TPConfigError, match="does not divide the model's " + problem.replace(
            "(", r"\(").replace(")", r"\)")):
        TensorParallel(0, tp).check(config)


def test_each_rank_reads_the_kv_heads_of_its_query_heads() -> None:
    """GQA: query head h reads KV head h // (heads / KV heads), on every split."""
    for heads, kv, tp in [(8, 2, 4), (8, 2, 8), (8, 4, 2), (4, 1, 4), (9, 3, 3)]:
        config = ModelConfig.from_hf_dict({
            "vocab_size": 100, "hidden_size": heads * 16, "intermediate_size": 64 * tp,
            "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv})
        for rank in range(tp):
            part = TensorParallel(rank, tp)
            (h0, h1), (k0, k1) = part.heads(config), part.kv_heads(config)
            group = heads // kv
            assert {h // group for h in range(h0, h1)} == set(range(k0, k1)), (heads, kv, tp, rank)


def test_vocab_rows_cover_the_vocabulary_once() -> None:
    for vocab, tp in [(49155, 4), (49152, 3), (10, 4)]:
        spans = [TensorParallel(r, tp).vocab(vocab) for r in range(tp)]
        assert [i for lo, hi in spans for i in range(lo, hi)] == list(range(vocab))


def test_a_call_to_a_rank_that_reads_nothing_times_out() -> None:
    """The KV call socket between rank 0 and a follower: messages both ways, and a send to a
    peer that stopped reading (a hung rank) fails within its timeout instead of hanging."""
    import socket
    import time

    from runtime.scheduler.ranks import Calls

    a, b = socket.socketpair()
    ours, theirs = Calls(a, timeout_s=0.5), Calls(b, timeout_s=0.5)
    try:
        ours.send(("call", 1, "revoke", (7,)))
        assert theirs.recv() == ("call", 1, "revoke", (7,))
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="read nothing"):
            ours.send(b"x" * (64 << 20))  # more than the socket buffers hold
        assert time.monotonic() - start < 5
    finally:
        ours.close()
        theirs.close()
