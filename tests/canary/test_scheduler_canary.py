"""The KV canary in the scheduler, on the fake runner (whose tokens come from the KV it reads
through the req->token table, so a misplaced slot changes them).

No false alarms: shared prefixes in the prefix cache, repeats, chunked prompts, aborts and
retractions under a tiny pool, with and without overlap, check every step with zero violations.
Faults injected into the table (req_to_token, wrong_slots) are all caught under `raise`: every
hit request ends with the canary's error, every other one is token-exact, KV ends up empty.
"""

from __future__ import annotations

import random

import pytest

from runtime.config import CanaryConfig, SchedulerConfig
from runtime.sampling_params import SamplingParams
from runtime.scheduler.req import Req
from runtime.scheduler.scheduler import Scheduler
from tests.scheduler.fake_runner import FakeRunner, expected_outputs
from tests.scheduler.test_scheduler import assert_correct, churn, run

RAISE = CanaryConfig(kv_canary="raise")


def words(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def req(rid: str, prompt: list[int], max_new: int, ignore_eos: bool = False) -> Req:
    return Req(rid, list(prompt), SamplingParams(max_new_tokens=max_new, temperature=0.0,
                                                 ignore_eos=ignore_eos))


def clean(sched: Scheduler) -> None:
    assert sched.canary is not None
    assert sched.canary.stats.checks > 0
    assert sched.canary.stats.violations == {}, sched.canary.stats


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_shared_prefixes_repeats_and_chunks_raise_nothing(overlap: bool) -> None:
    rng = random.Random(3)
    runner = FakeRunner(num_pages=256, page_size=4, prefix_cache=True, canary=RAISE)
    sched = Scheduler(SchedulerConfig(enable_overlap=overlap, chunked_prefill_size=16), runner,
                      canary=RAISE)
    system = words(22, rng)
    prompts = [system + words(rng.randrange(1, 9), rng) for _ in range(10)] + [words(5, rng)]
    for round_ in range(3):  # rounds 2 and 3 read the cached pages of round 1
        reqs = [req(f"{round_}-{i}", p, 5 + i % 4) for i, p in enumerate(prompts)]
        run(sched, reqs)
        assert_correct(reqs)
    assert sum(r.cached_tokens for r in reqs) > 0
    clean(sched)
    assert runner.kv.is_all_free()
    sched.shutdown()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_aborts_and_retractions_under_a_tiny_pool_raise_nothing(overlap: bool) -> None:
    rng = random.Random(4)
    runner = FakeRunner(num_pages=14, page_size=4, prefix_cache=True, canary=RAISE)
    sched = Scheduler(SchedulerConfig(enable_overlap=overlap, chunked_prefill_size=8), runner,
                      canary=RAISE)
    system = words(9, rng)
    reqs = [req(f"r{i}", (system if i % 2 else []) + words(rng.randrange(2, 12), rng),
                rng.randrange(4, 20)) for i in range(40)]
    churn(sched, reqs, rng, abort_p=0.05, steps=20_000)
    assert sched.decode.num_retractions > 0, "the pool was meant to be too small for everyone"
    clean(sched)
    assert runner.kv.is_all_free()
    sched.shutdown()


@pytest.mark.parametrize("kind", ["req_to_token", "wrong_slots"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_table_faults_are_all_caught_and_nobody_else_is_hurt(kind: str, overlap: bool) -> None:
    config = CanaryConfig(kv_canary="raise", perturb=f"{kind}=0.05", perturb_seed=7)
    rng = random.Random(5)
    runner = FakeRunner(num_pages=512, page_size=4, max_reqs=16, canary=config)
    sched = Scheduler(SchedulerConfig(enable_overlap=overlap, max_running_requests=16), runner,
                      canary=config)
    reqs = [req(f"r{i}", words(rng.randrange(3, 30), rng), rng.randrange(5, 40), ignore_eos=True)
            for i in range(120)]
    run(sched, reqs)
    monitor = sched.canary
    assert monitor is not None
    assert len(monitor.injected) >= 20, monitor.stats
    assert set(monitor.caught) == set(monitor.injected)
    assert monitor.stats.injections == {kind: len(monitor.injected)}
    for r in reqs:
        assert r.finished_reason is not None
        if r.rid in monitor.injected:
            assert r.finished_reason.kind == "abort", r.rid
            assert (r.finished_reason.message or "").startswith("KV canary:"), r.finished_reason
        else:
            want = expected_outputs(r.origin_input_ids, r.sampling_params.max_new_tokens)
            assert r.output_ids == want, r.rid
    assert runner.kv.is_all_free() and runner.kv.allocator.is_all_free()
    sched.shutdown()


def test_log_mode_counts_and_lets_requests_run() -> None:
    config = CanaryConfig(kv_canary="log", perturb="req_to_token=0.05", perturb_seed=1)
    rng = random.Random(6)
    runner = FakeRunner(num_pages=512, page_size=4, max_reqs=16, canary=config)
    sched = Scheduler(SchedulerConfig(enable_overlap=False, max_running_requests=16), runner,
                      canary=config)
    reqs = [req(f"r{i}", words(rng.randrange(3, 30), rng), 30, ignore_eos=True) for i in range(40)]
    run(sched, reqs)
    monitor = sched.canary
    assert monitor is not None and len(monitor.injected) >= 10
    assert monitor.caught == {} and monitor.stats.violations["tag"] >= len(monitor.injected)
    assert all(r.finished_reason is not None and r.finished_reason.kind == "length" for r in reqs)
    hurt = [r.rid for r in reqs if r.output_ids != expected_outputs(r.origin_input_ids, 30)]
    assert hurt and set(hurt) <= set(monitor.injected), "only the hit requests answer wrong"
    assert runner.kv.is_all_free()


def test_the_sweep_bounds_decode_checks_and_off_costs_nothing() -> None:
    checks = {}
    for sweep in (1, 4):
        config = CanaryConfig(kv_canary="raise", kv_canary_sweep=sweep)
        runner = FakeRunner(canary=config)
        sched = Scheduler(SchedulerConfig(enable_overlap=False), runner, canary=config)
        run(sched, [req("one", [1, 2, 3], 40)])
        assert sched.canary is not None
        checks[sweep] = sched.canary.stats.checks
        assert all(b.canary is not None for b in runner.batches)
    assert checks[1] == 40 and checks[4] == 1 + 39 // 4  # the prefill, then every 4th decode step
    runner = FakeRunner()
    sched = Scheduler(SchedulerConfig(enable_overlap=False), runner)
    run(sched, [req("one", [1, 2, 3], 5)])
    assert sched.canary is None and runner.canary is None
    assert all(b.canary is None for b in runner.batches)
