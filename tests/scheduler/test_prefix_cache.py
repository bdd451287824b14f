"""The scheduler with a prefix cache, on the fake runner (which reads every token back through
the req->token table, so a wrong, stale or evicted-while-read page changes its output)."""

from __future__ import annotations

import os
import random

import pytest

from runtime.config import SchedulerConfig
from runtime.sampling_params import SamplingParams
from runtime.scheduler.req import Req
from runtime.scheduler.scheduler import Scheduler
from tests.scheduler.fake_runner import FakeRunner
from tests.scheduler.test_scheduler import assert_correct, churn, run

FUZZ_SEEDS = int(os.environ.get("BATON_FUZZ_SEEDS", "8"))
PS = 4


def req(rid: str, prompt: list[int], max_new: int) -> Req:
    return Req(rid, list(prompt), SamplingParams(max_new_tokens=max_new, temperature=0.0))


def words(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def settle(sched: Scheduler, runner: FakeRunner) -> None:
    """Nothing held by a request; then the flush leaves the allocator all free."""
    assert not sched.has_work()
    assert runner.kv.is_all_free(), "a page is held by nobody's request but not the cache's"
    runner.kv.flush_cache()
    assert runner.kv.allocator.is_all_free() and runner.kv.cache is not None
    assert runner.kv.cache.cached_pages == 0


@pytest.mark.parametrize("overlap", [True, False])
def test_a_second_round_reuses_every_full_page_and_outputs_stay_exact(overlap: bool) -> None:
    """Prefixes of 0, 1 and many pages, prompts ending exactly on a page boundary; the second
    round finds every full page but the one holding the last token (it must be computed to
    sample the next)."""
    runner = FakeRunner(num_pages=256, page_size=PS, prefix_cache=True)
    sched = Scheduler(SchedulerConfig(enable_overlap=overlap, chunked_prefill_size=16), runner)
    system = words(5 * PS, seed=1)
    prompts = [words(3, 2), words(PS, 3), words(2 * PS, 4), system + words(1, 5),
               system + words(PS, 6), system + words(PS + 3, 7), system[:PS] + words(9, 8),
               system[: 3 * PS]]
    first = [req(f"a{i}", p, 6) for i, p in enumerate(prompts)]
    run(sched, first)
    assert_correct(first)
    second = [req(f"b{i}", p, 6) for i, p in enumerate(prompts)]
    run(sched, second)
    assert_correct(second)
    for r in second:
        assert r.cached_tokens == (len(r.origin_input_ids) - 1) // PS * PS, r.rid
    assert sum(r.cached_tokens for r in first) > 0, "the shared system prompt hit in round 1"
    stats = runner.kv.cache.stats  # type: ignore[union-attr]
    everyone = first + second  # each counted once, however many steps it waited in the queue
    assert stats.query_tokens == sum(len(r.origin_input_ids) for r in everyone)
    assert stats.hit_tokens == sum(r.cached_tokens for r in everyone)
    settle(sched, runner)
    sched.shutdown()


def test_a_multi_turn_conversation_hits_its_own_history() -> None:
    runner = FakeRunner(num_pages=256, page_size=PS, prefix_cache=True)
    sched = Scheduler(SchedulerConfig(enable_overlap=True), runner)
    history = words(10, 1)
    for turn in range(5):
        r = req(f"t{turn}", history, 7)
        run(sched, [r])
        assert_correct([r])
        if turn:
            assert r.cached_tokens >= (len(history) - 12) // PS * PS
        history = history + r.output_ids + words(5, 10 + turn)
    settle(sched, runner)
    sched.shutdown()


def test_cached_pages_are_evicted_before_anything_is_retracted_or_refused() -> None:
    runner = FakeRunner(num_pages=24, page_size=PS, max_reqs=4, prefix_cache=True)
    sched = Scheduler(SchedulerConfig(enable_overlap=False), runner)
    olds = [req(f"old{i}", words(30, i), 2) for i in range(3)]  # fill the cache (24 pages)
    for r in olds:
        run(sched, [r])
    assert runner.kv.cache is not None and runner.kv.cache.cached_pages >= 18
    new = req("new", words(40, 99), 20)  # needs 15 pages: most of the cache goes
    run(sched, [new])
    assert_correct([*olds, new])
    assert sched.decode.num_retractions == 0 and runner.kv.cache.stats.evicted_tokens > 0
    settle(sched, runner)
    sched.shutdown()


@pytest.mark.parametrize("overlap", [True, False])
def test_an_abort_mid_prefill_caches_only_what_was_computed(overlap: bool) -> None:
    runner = FakeRunner(num_pages=128, page_size=PS, context_len=512, prefix_cache=True)
    sched = Scheduler(SchedulerConfig(enable_overlap=overlap, chunked_prefill_size=8), runner)
    prompt = words(80, 3)
    long = req("long", prompt, 4)
    sched.add_request(long)
    for _ in range(4):  # a few 8-token chunks
        sched.step()
    done = long.kv.computed
    assert 0 < done < len(prompt)
    assert sched.abort("long")
    sched.step()
    assert runner.kv.cache is not None
    kept = runner.kv.cache.cached_pages * PS
    assert 0 < kept <= done, "what was computed, and only that, was cached"
    again = req("again", prompt, 4)
    run(sched, [again])
    assert_correct([again])
    assert again.cached_tokens == min(kept, (len(prompt) - 1) // PS * PS)
    settle(sched, runner)
    sched.shutdown()


def test_n_copies_of_one_prompt_at_once_share_nothing_stale() -> None:
    runner = FakeRunner(num_pages=128, page_size=PS, prefix_cache=True)
    sched = Scheduler(SchedulerConfig(enable_overlap=True, chunked_prefill_size=8), runner)
    prompt = words(37, 5)
    copies = [req(f"n{i}", prompt, 5 + i) for i in range(4)]
    run(sched, copies)
    assert_correct(copies)
    settle(sched, runner)
    sched.shutdown()


@pytest.mark.parametrize("seed", range(FUZZ_SEEDS))
def test_randomized_shared_prefixes_aborts_retractions_and_a_tiny_pool(seed: int) -> None:
    """Random arrivals over 5 shared prefixes, aborts, a pool that forces eviction and
    retraction: every output exact, every finish reported once, nothing leaked."""
    rng = random.Random(seed)
    runner = FakeRunner(num_pages=28, page_size=PS, max_reqs=6, prefix_cache=True)
    config = SchedulerConfig(enable_overlap=seed % 2 == 0,
                             chunked_prefill_size=rng.choice([8, 16, 64]), max_running_requests=6)
    sched = Scheduler(config, runner)
    stems = [words(rng.randrange(0, 30), 100 + k) for k in range(5)]
    reqs = [req(f"r{i}", rng.choice(stems) + words(rng.randrange(1, 12), i),
                rng.randrange(1, 30)) for i in range(40)]
    churn(sched, reqs, rng, abort_p=0.02, steps=8000)
    assert runner.kv.cache is not None and runner.kv.cache.stats.hit_tokens > 0
    settle(sched, runner)
    sched.shutdown()


def test_a_request_waiting_for_room_pins_nothing_and_is_counted_once() -> None:
    """A request whose cached prefix is found but whose suffix does not fit yet lets the prefix
    go while it waits (it stays evictable), and its lookup counts once, when it is admitted."""
    runner = FakeRunner(num_pages=20, page_size=PS, prefix_cache=True)
    # a full decode reserve: the running request keeps room for all 60 of its tokens
    sched = Scheduler(SchedulerConfig(enable_overlap=False, new_token_ratio=1.0), runner)
    stem = words(12, 1)
    run(sched, [req("warm", stem, 2)])  # the stem's 3 pages are cached now
    big = req("big", words(12, 2), 60)
    sched.add_request(big)
    sched.step()
    late = req("late", [*stem, 5], 4)
    sched.add_request(late)
    waited = 0
    while late in sched.waiting:
        assert late.kv.node is None and not late.kv.pages, "a waiting request pins pages"
        sched.step()
        waited += 1
    run(sched, [])
    # it waited unlocked, so the big one's growth could evict the stem's least recent page
    assert waited > 10 and 0 < late.cached_tokens <= 12
    assert_correct([big, late])
    stats = runner.kv.cache.stats  # type: ignore[union-attr]
    assert stats.query_tokens == 12 + 12 + 13 and stats.hit_tokens == late.cached_tokens
    settle(sched, runner)
    sched.shutdown()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_burst_sharing_a_long_prefix_computes_it_once(overlap: bool) -> None:
    """8 prompts with one 80-token stem arrive at once: the first computes the stem, the others
    wait for it to reach the cache (a step or two) instead of computing it 7 more times; a
    short shared head (under the threshold) holds nobody back."""
    runner = FakeRunner(num_pages=256, page_size=PS, prefix_cache=True)
    sched = Scheduler(SchedulerConfig(enable_overlap=overlap, chunked_prefill_size=512), runner)
    stem = words(80, 1)
    burst = [req(f"b{i}", [*stem, *words(3, 10 + i)], 4) for i in range(8)]
    run(sched, burst)
    assert_correct(burst)
    prompt_tokens = sum(b.extend_lens_t.sum().item() for b in runner.batches if b.mode == "extend")
    assert prompt_tokens <= 83 + 7 * 7, "the stem was computed more than once"
    assert sorted(r.cached_tokens for r in burst) == [0] + [80] * 7
    short = [req(f"s{i}", [*words(8, 2), *words(30, 20 + i)], 2) for i in range(4)]
    runner.batches.clear()
    run(sched, short)
    assert_correct(short)
    first_prefill = next(b for b in runner.batches if b.mode == "extend")
    assert first_prefill.batch_size == 4, "a short shared head deferred someone"
    settle(sched, runner)
    sched.shutdown()
