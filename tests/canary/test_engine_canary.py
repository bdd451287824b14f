"""The KV canary on the real model (the tiny random Llama with large weights, whose greedy
tokens hang on attention), through the offline Engine.

Clean: shared prefixes read from the prefix cache, with tags and every layer's byte checksums
checked at every step, raise nothing and change no token. Faults: for each kind the runner
injects, `raise` catches every request hit (injected == caught over >= 20 of them), each ends
with the canary's message, every other request is token-exact with an unperturbed run, and
every page comes back.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from runtime import Engine
from runtime.canary.identity import rid_to_int64
from runtime.canary.oracle import oracle_sequence

PAGE = 4
MAX_NEW = 20
N_REQS = 64
KINDS = {  # kind -> what else it needs to be caught
    "kv_after_forward": {"kv_canary_bytes": "all"},
    "req_to_token": {},
    "wrong_slots": {},
    "next_token_swap": {"sampler_backend": "token_oracle"},
}


@pytest.fixture(scope="module")
def sharp_tiny(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.disagg.pd import tiny_model

    return tiny_model(model_path, tmp_path_factory.mktemp("sharp-tiny"), init_range=0.2)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(11)
    system = [rng.randrange(100, 40000) for _ in range(3 * PAGE + 1)]
    return [(system if i % 3 == 0 else []) + [rng.randrange(100, 40000)
                                              for _ in range(rng.randrange(2, 30))]
            for i in range(N_REQS)]


PARAMS = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


def generate(model: Path, prompts: list[list[int]], **kwargs: Any) -> tuple[list[dict[str, Any]], Engine]:
    engine = Engine(model=str(model), page_size=PAGE, max_running_requests=24, **kwargs)
    try:
        return engine.generate(prompts, PARAMS), engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def reference(sharp_tiny: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Unperturbed outputs with the torch sampler, canary off."""
    return [r["output_ids"] for r in generate(sharp_tiny, prompts)[0]]


def oracle_outputs(out: list[dict[str, Any]], prompts: list[list[int]], vocab: int) -> list[list[int]]:
    """What the token oracle gives each request (keyed on its rid, new each run)."""
    return [oracle_sequence(rid_to_int64(r["meta_info"]["id"]), len(p), MAX_NEW, vocab)
            for r, p in zip(out, prompts, strict=True)]


def test_clean_runs_raise_nothing_and_change_no_token(
        sharp_tiny: Path, prompts: list[list[int]], reference: list[list[int]]) -> None:
    out, engine = generate(sharp_tiny, prompts + prompts, kv_canary="raise", kv_canary_bytes="all")
    assert [r["output_ids"] for r in out] == reference * 2
    monitor = engine.scheduler.canary
    assert monitor is not None and monitor.stats.checks > N_REQS * MAX_NEW
    assert monitor.stats.violations == {}
    assert sum(r["meta_info"]["cached_tokens"] for r in out) > 0, "the cache shared pages"
    assert engine.runner.kv.is_all_free()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_injected_fault_is_caught_and_nobody_else_is_hurt(
        kind: str, overlap: bool, sharp_tiny: Path, prompts: list[list[int]],
        reference: list[list[int]]) -> None:
    extra = KINDS[kind]
    out, engine = generate(sharp_tiny, prompts, kv_canary="raise", perturb=f"{kind}=0.06",
                           perturb_seed=3, enable_overlap=overlap, **extra)
    monitor = engine.scheduler.canary
    assert monitor is not None
    assert len(monitor.injected) >= 20, monitor.stats
    assert set(monitor.caught) == set(monitor.injected)
    assert monitor.stats.injections == {kind: len(monitor.injected)}
    oracle = "sampler_backend" in extra
    want = oracle_outputs(out, prompts, engine.runner.vocab_size) if oracle else reference
    for r, expected in zip(out, want, strict=True):
        reason = r["meta_info"]["finish_reason"]
        if r["meta_info"]["id"] in monitor.injected:
            assert reason["type"] == "abort" and reason["message"].startswith("KV canary:"), reason
        else:
            assert r["output_ids"] == expected and reason["type"] == "length"
    kv = engine.runner.kv
    assert kv.is_all_free()
    kv.flush_cache()
    assert kv.allocator.is_all_free()


@pytest.mark.parametrize("tp", [2, 4], ids=["tp2", "tp4-kv-copied"])
def test_under_tp_a_fault_in_any_rank_s_pages_is_caught(tp: int, sharp_tiny: Path,
                                                        prompts: list[list[int]]) -> None:
    """Every rank checks its own KV heads' bytes and rank 0 sees what any rank found: the KV
    strikes land on the ranks in turn, followers first (runtime/canary/perturb.py), over 4
    ranks on copies of the 2 KV heads too. The token oracle samples, so the tokens do not hang
    on how the ranks round their sums."""
    out, engine = generate(sharp_tiny, prompts[:12], tp=tp, kv_canary="raise",
                           kv_canary_bytes="all", sampler_backend="token_oracle",
                           perturb="kv_after_forward=0.08", perturb_seed=4)
    monitor = engine.scheduler.canary
    assert monitor is not None
    assert len(monitor.injected) >= tp, monitor.stats  # every rank struck at least once
    assert set(monitor.caught) == set(monitor.injected)
    assert monitor.stats.violations == {"bytes": len(monitor.injected)}
    want = oracle_outputs(out, prompts[:12], engine.runner.vocab_size)
    for r, expected in zip(out, want, strict=True):
        if r["meta_info"]["id"] not in monitor.injected:
            assert r["output_ids"] == expected
    assert engine.runner.kv.is_all_free()
