"""The prefix cache on the real model: greedy output with the cache on equals HF transformers'
(near-tie rule) on prompts that share prefixes of 0, 1 and many pages, one ending exactly on a
page boundary, sent together and then again (the second round hits), and on multi-turn
conversations where each turn extends the last answer. Logprobs must match HF's up to the
first divergence: a cached page holding the wrong KV would shift them."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from runtime import Engine
from tests.engine.hf_reference import Reference, compare, hf_greedy

MAX_NEW = 16
PAGE = 16
SYSTEM = ("You are a careful assistant for a small bakery. Answer in one short sentence, "
          "mention prices in euros, and never invent opening hours. The shop sells bread, "
          "croissants, three kinds of cake and coffee; it is closed on Mondays.")
QUESTIONS = ["What do you sell?", "Are you open on Monday?", "How much is a croissant?",
             "Do you have coffee?", "Can I order a cake for Saturday?"]


@pytest.fixture(scope="module")
def shared_prompts(tokenizer: Any) -> list[list[int]]:
    system = tokenizer.encode(SYSTEM)
    assert len(system) > 3 * PAGE
    prompts = [system + tokenizer.encode(" " + q) for q in QUESTIONS]
    prompts.append(tokenizer.encode("Tell me a story about a fox."))  # shares nothing
    prompts.append(system[:PAGE] + tokenizer.encode(" The weather today is"))  # one page
    prompts.append(system[: 3 * PAGE])  # ends exactly on a page boundary
    return prompts


@pytest.fixture(scope="module")
def shared_refs(model_path: Path, shared_prompts: list[list[int]]) -> list[Reference]:
    return hf_greedy(model_path, shared_prompts, MAX_NEW)


def check(results: list[dict[str, Any]], refs: list[Reference], where: str) -> None:
    notes = [compare(r["output_ids"], ref, [lp for lp, _ in r["meta_info"]["output_token_logprobs"]])
             for r, ref in zip(results, refs, strict=True)]
    for note in filter(None, notes):
        warnings.warn(f"{where}: {note}", stacklevel=1)
    assert sum(n is not None for n in notes) <= 1, notes


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_shared_prefixes_match_hf_cold_and_cached(
        shared_prompts: list[list[int]], shared_refs: list[Reference], overlap: bool) -> None:
    engine = Engine(page_size=PAGE, enable_overlap=overlap, chunked_prefill_size=64)
    params = {"temperature": 0, "max_new_tokens": MAX_NEW}
    try:
        cold = engine.generate(shared_prompts, params, return_logprob=True)
        check(cold, shared_refs, "cold")
        warm = engine.generate(shared_prompts, params, return_logprob=True)
        check(warm, shared_refs, "cached")
        for prompt, r in zip(shared_prompts, warm, strict=True):
            assert r["meta_info"]["cached_tokens"] == (len(prompt) - 1) // PAGE * PAGE
        assert engine.runner.kv.is_all_free(), "a page is held after every request ended"
        assert engine.runner.kv.flush_cache() > 0 and engine.runner.kv.allocator.is_all_free()
    finally:
        engine.shutdown()


def test_the_cache_off_serves_the_same_tokens_and_caches_nothing(
        shared_prompts: list[list[int]], shared_refs: list[Reference]) -> None:
    engine = Engine(page_size=PAGE, disable_prefix_cache=True)
    try:
        for _ in range(2):
            out = engine.generate(shared_prompts, {"temperature": 0, "max_new_tokens": MAX_NEW},
                                  return_logprob=True)
            check(out, shared_refs, "cache off")
            assert all(r["meta_info"]["cached_tokens"] == 0 for r in out)
        assert engine.runner.kv.cache is None and engine.runner.kv.allocator.is_all_free()
    finally:
        engine.shutdown()


def test_multi_turn_conversations_reuse_their_history(model_path: Path, tokenizer: Any) -> None:
    """4 conversations, 3 turns each: turn k's prompt is turn k-1's prompt, its answer and a
    new user line, so everything but the new line is cached."""
    engine = Engine(page_size=PAGE)
    params = {"temperature": 0, "max_new_tokens": MAX_NEW}
    histories = [tokenizer.encode(f"User: {q}\nAssistant:") for q in QUESTIONS[:4]]
    try:
        for turn in range(3):
            refs = hf_greedy(model_path, histories, MAX_NEW)
            out = engine.generate(histories, params, return_logprob=True)
            check(out, refs, f"turn {turn}")
            for history, r in zip(histories, out, strict=True):
                if turn:
                    assert r["meta_info"]["cached_tokens"] >= (len(history) - 24) // PAGE * PAGE
            histories = [h + r["output_ids"] + tokenizer.encode("\nUser: And then?\nAssistant:")
                         for h, r in zip(histories, out, strict=True)]
        assert engine.runner.kv.is_all_free()
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def sharp_tiny(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with large weights: its greedy tokens hang on attention, so a page
    holding anything but the request's own KV shows in its output."""
    from tests.disagg.pd import tiny_model

    return tiny_model(model_path, tmp_path_factory.mktemp("sharp-tiny"), init_range=0.2)


def test_eviction_stress_every_output_equals_the_cache_off_output(sharp_tiny: Path) -> None:
    """A pool with room for about three long prompts, 200 requests over 20 long prefixes, 16 at
    a time: eviction and retraction all the way, never a deadlock, outputs as without a cache,
    and at the end every page free or cached unlocked (the flush frees them all)."""
    import random

    rng = random.Random(7)
    stems = [[rng.randrange(100, 40000) for _ in range(rng.randrange(180, 260))] for _ in range(20)]
    prompts = [rng.choice(stems) + [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 20))]
               for _ in range(200)]
    params = {"temperature": 0, "max_new_tokens": 8}
    reference = Engine(model=str(sharp_tiny), page_size=PAGE, disable_prefix_cache=True)
    try:
        want = [r["output_ids"] for r in reference.generate(prompts, params)]
    finally:
        reference.shutdown()
    engine = Engine(model=str(sharp_tiny), page_size=PAGE, max_total_tokens=3 * 288,
                    max_running_requests=16, chunked_prefill_size=128)
    try:
        got = engine.generate(prompts, params)
        assert [r["output_ids"] for r in got] == want
        cache = engine.runner.kv.cache
        assert cache is not None and cache.stats.evicted_tokens > 0 and cache.stats.hit_tokens > 0
        assert sum(r["meta_info"]["cached_tokens"] for r in got) > 0
        assert engine.scheduler.decode.num_retractions > 0 or engine.scheduler.decode.peak_running < 16
        assert engine.runner.kv.is_all_free()
        engine.runner.kv.flush_cache()
        assert engine.runner.kv.allocator.is_all_free() and cache.cached_pages == 0
    finally:
        engine.shutdown()
