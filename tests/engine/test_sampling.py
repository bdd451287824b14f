"""Sampling behaviour of the real engine: seeds, filters, penalties, stops, logprobs, backends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime import Engine
from runtime.engine.sampler import (
    SamplerOutput,
    TorchSampler,
    register_sampler_backend,
)
from runtime.forward_batch import SamplingBatchInfo

PROMPT = "Write a short poem about the sea:"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    e = Engine(max_total_tokens=4096)
    yield e
    assert e.runner.kv.is_all_free()
    e.shutdown()


def gen(engine: Engine, prompts: list[str], **params: Any) -> list[dict[str, Any]]:
    return engine.generate(prompts, params)  # type: ignore[no-any-return]


def test_same_seed_same_output_whatever_the_batch(engine: Engine) -> None:
    params = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 24, "seed": 1234}
    alone = gen(engine, [PROMPT], **params)[0]["output_ids"]
    crowd = gen(engine, ["Hello there", PROMPT, "def f(x):"], **params)[1]["output_ids"]
    assert alone == crowd
    other = gen(engine, [PROMPT], **{**params, "seed": 99})[0]["output_ids"]
    assert other != alone


def test_unseeded_sampling_varies(engine: Engine) -> None:
    outs = gen(engine, [PROMPT] * 4, temperature=1.5, max_new_tokens=16)
    assert len({tuple(o["output_ids"]) for o in outs}) > 1


def test_filters_that_leave_one_token_equal_greedy(engine: Engine) -> None:
    greedy = gen(engine, [PROMPT], temperature=0, max_new_tokens=16)[0]["output_ids"]
    for params in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        got = gen(engine, [PROMPT], temperature=0.8, max_new_tokens=16, seed=5, **params)
        assert got[0]["output_ids"] == greedy, params


def test_repetition_penalty_matches_hf(engine: Engine, model_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    ids = engine.tokenizer.encode("one two one two one two one")
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    want = hf.generate(
        torch.tensor([ids]), max_new_tokens=16, do_sample=False, repetition_penalty=1.5, pad_token_id=2
    )[0, len(ids) :].tolist()
    got = engine.generate([ids], {"temperature": 0, "max_new_tokens": 16, "repetition_penalty": 1.5})
    assert got[0]["output_ids"] == want


def test_frequency_and_presence_penalties_match_reference(engine: Engine, model_path: Path) -> None:
    """Reference: HF forward, greedy over logits - f * count - p * (count > 0) of output tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids = engine.tokenizer.encode("Repeat after me: la la la la la")
    freq, pres, n = 0.7, 0.4, 12
    seq, out = list(ids), []
    counts = torch.zeros(engine.runner.vocab_size)
    with torch.inference_mode():
        for _ in range(n):
            logits = hf(torch.tensor([seq])).logits[0, -1]
            tok = int((logits - freq * counts - pres * (counts > 0).float()).argmax())
            counts[tok] += 1
            seq.append(tok)
            out.append(tok)
    got = engine.generate(
        [ids],
        {"temperature": 0, "max_new_tokens": n, "frequency_penalty": freq, "presence_penalty": pres},
    )
    assert got[0]["output_ids"] == out


def test_stop_string_and_stop_token(engine: Engine) -> None:
    base = gen(engine, [PROMPT], temperature=0, max_new_tokens=32)[0]
    text = base["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = gen(engine, [PROMPT], temperature=0, max_new_tokens=32, stop=[stop])[0]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop, "message": None}
    assert cut["text"] == text[: text.index(stop)]
    stop_id = base["output_ids"][4]
    first = base["output_ids"].index(stop_id)
    by_id = gen(engine, [PROMPT], temperature=0, max_new_tokens=32, stop_token_ids=[stop_id])[0]
    assert by_id["output_ids"] == base["output_ids"][: first + 1]
    assert by_id["meta_info"]["finish_reason"]["matched"] == stop_id


def test_eos_and_ignore_eos(engine: Engine) -> None:
    prompt = "Explain why the sky is blue. " * 6
    stopped = gen(engine, [prompt], temperature=0, max_new_tokens=40)[0]
    assert stopped["meta_info"]["finish_reason"]["type"] == "stop"
    assert stopped["output_ids"][-1] == 2 and len(stopped["output_ids"]) < 40
    forced = gen(engine, [prompt], temperature=0, max_new_tokens=40, ignore_eos=True)[0]
    assert len(forced["output_ids"]) == 40
    assert forced["meta_info"]["finish_reason"]["type"] == "length"
    assert forced["output_ids"][: len(stopped["output_ids"])] == stopped["output_ids"]


def test_logprobs_match_hf(engine: Engine, model_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    ids = engine.tokenizer.encode(PROMPT)
    out = engine.generate([ids], {"temperature": 0, "max_new_tokens": 4}, top_logprobs_num=3)[0]
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.inference_mode():
        logits = hf(torch.tensor([ids + out["output_ids"]])).logits[0]
    ref = torch.log_softmax(logits[len(ids) - 1 : -1], dim=-1)
    pairs = out["meta_info"]["output_token_logprobs"]
    for step, (lp, tok) in enumerate(pairs):
        assert abs(lp - float(ref[step, tok])) < 1e-3
        top = out["meta_info"]["output_top_logprobs"][step]
        assert [t for t, _ in top] == ref[step].topk(3).indices.tolist()


class MirrorSampler(TorchSampler):
    """Mirrors each sampled id into customized_info["mirror"]."""

    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SamplerOutput:
        out = super().sample(logits, info)
        out.customized_info = {"mirror": out.next_token_ids.tolist()}
        return out


def test_custom_sampler_backend_customized_info() -> None:
    register_sampler_backend("mirror-test", MirrorSampler)
    e = Engine(sampler_backend="mirror-test", max_total_tokens=2048)
    try:
        outs = e.generate([PROMPT, "Hi"], {"temperature": 0.7, "max_new_tokens": 10, "seed": 3})
        for o in outs:
            assert o["meta_info"]["customized_info"]["mirror"] == o["output_ids"]
    finally:
        e.shutdown()
    with pytest.raises(TypeError):
        register_sampler_backend("bad", dict)  # type: ignore[arg-type]
