"""Scheduler policy with a fake runner: admission, chunking, retraction, overlap, abort."""

from __future__ import annotations

import os
import random

import pytest
import torch

from runtime.config import SchedulerConfig
from runtime.sampling_params import InvalidRequest, SamplingParams
from runtime.scheduler.batch import ScheduleBatch
from runtime.scheduler.future import FutureMap
from runtime.scheduler.req import Req
from runtime.scheduler.scheduler import DRAIN_CHUNK_TOKENS, Scheduler
from tests.scheduler.fake_runner import FakeRunner, expected_outputs

FUZZ_SEEDS = int(os.environ.get("BATON_FUZZ_SEEDS", "8"))  # 300 passed locally


def make_req(rid: str, prompt_len: int, max_new: int, seed: int = 0) -> Req:
    rng = random.Random(seed)
    prompt = [rng.randrange(1000) for _ in range(prompt_len)]
    return Req(rid, prompt, SamplingParams(max_new_tokens=max_new, temperature=0.0))


def run(sched: Scheduler, reqs: list[Req], max_steps: int = 10_000) -> None:
    for r in reqs:
        sched.add_request(r)
    for _ in range(max_steps):
        if not sched.has_work():
            return
        sched.step()
    raise AssertionError("scheduler did not finish")


def assert_correct(reqs: list[Req]) -> None:
    for r in reqs:
        want = expected_outputs(r.origin_input_ids, r.sampling_params.max_new_tokens)
        assert r.output_ids == want, f"{r.rid}: got {r.output_ids} want {want}"
        assert r.finished_reason is not None and r.finished_reason.kind == "length"


@pytest.mark.parametrize("overlap", [True, False])
def test_continuous_batching_outputs_and_kv_freed(overlap: bool) -> None:
    runner = FakeRunner()
    sched = Scheduler(SchedulerConfig(enable_overlap=overlap), runner)
    reqs = [make_req(f"r{i}", 3 + 5 * i, 6 + i, seed=i) for i in range(6)]
    run(sched, reqs)
    assert_correct(reqs)
    assert runner.kv.is_all_free()
    sched.shutdown()


def test_admission_respects_max_running_requests() -> None:
    runner = FakeRunner()
    sched = Scheduler(SchedulerConfig(max_running_requests=2, enable_overlap=False), runner)
    reqs = [make_req(f"r{i}", 5, 4, seed=i) for i in range(5)]
    run(sched, reqs)
    assert max(b.batch_size for b in runner.batches if b.mode == "decode") <= 2
    assert_correct(reqs)


def test_new_requests_join_while_others_decode() -> None:
    runner = FakeRunner()
    sched = Scheduler(SchedulerConfig(enable_overlap=False), runner)
    first = make_req("first", 4, 20)
    sched.add_request(first)
    for _ in range(5):
        sched.step()
    late = make_req("late", 4, 5, seed=1)
    run(sched, [late])
    decode_sizes = [b.batch_size for b in runner.batches if b.mode == "decode"]
    assert 2 in decode_sizes, "the late request never decoded alongside the first"
    assert_correct([first, late])


@pytest.mark.parametrize("overlap", [True, False])
def test_chunked_prefill_respects_token_budget(overlap: bool) -> None:
    runner = FakeRunner()
    sched = Scheduler(SchedulerConfig(chunked_prefill_size=8, enable_overlap=overlap), runner)
    reqs = [make_req("long", 30, 5), make_req("short", 3, 5, seed=1)]
    run(sched, reqs)
    extends = [b for b in runner.batches if b.mode == "extend"]
    assert all(sum(b.extend_lens) <= 8 for b in extends)
    assert len(extends) >= 4  # 30 tokens in chunks of at most 8
    assert_correct(reqs)
    assert runner.kv.is_all_free()


def test_draining_shrinks_the_prefill_chunks_of_a_prompt_under_way() -> None:
    """Issue 12, item 4: once the server drains, a step never prefills more than
    DRAIN_CHUNK_TOKENS, so the aborts at the end of the grace period wait for one short step."""
    runner = FakeRunner(num_pages=512, page_size=16, context_len=8192)
    sched = Scheduler(SchedulerConfig(chunked_prefill_size=2048, enable_overlap=False), runner)
    req = make_req("long", 6000, 2)
    sched.add_request(req)
    sched.step()
    assert runner.batches[-1].extend_lens == [2048]
    sched.drain()
    sched.step()
    assert runner.batches[-1].extend_lens == [DRAIN_CHUNK_TOKENS]
    assert sched.abort("long", "the server is shutting down")
    sched.step()
    assert req.finished_reason is not None and req.finished_reason.kind == "abort"
    assert not sched.has_work() and runner.kv.is_all_free()


@pytest.mark.parametrize("overlap", [True, False])
def test_retraction_when_decode_runs_out_of_kv(overlap: bool) -> None:
    runner = FakeRunner(num_pages=12, page_size=4)  # 48 tokens for 4 requests wanting 100
    sched = Scheduler(SchedulerConfig(enable_overlap=overlap), runner)
    reqs = [make_req(f"r{i}", 5, 20, seed=i) for i in range(4)]
    run(sched, reqs)
    assert sched.decode.num_retractions > 0
    assert_correct(reqs)
    assert runner.kv.is_all_free()


def test_request_too_big_for_pool_is_rejected_clearly() -> None:
    sched = Scheduler(SchedulerConfig(), FakeRunner(num_pages=4, page_size=4))
    with pytest.raises(InvalidRequest, match="pool holds 16") as e:
        sched.add_request(make_req("big", 10, 10))
    assert e.value.field == "max_new_tokens"
    with pytest.raises(InvalidRequest, match="empty"):
        sched.add_request(Req("empty", [], SamplingParams()))


@pytest.mark.parametrize("overlap", [True, False])
def test_abort_running_and_waiting_frees_kv(overlap: bool) -> None:
    runner = FakeRunner()
    sched = Scheduler(SchedulerConfig(max_running_requests=1, enable_overlap=overlap), runner)
    running, waiting = make_req("running", 6, 50), make_req("waiting", 6, 50, seed=1)
    sched.add_request(running)
    sched.add_request(waiting)
    for _ in range(4):
        sched.step()
    assert running.kv.pages and waiting in sched.waiting
    assert sched.abort("running") and sched.abort("waiting")
    assert not sched.abort("nope")
    outs = []
    while sched.has_work():
        outs += sched.step()
    assert {o.rid for o in outs if o.finished} >= {"running", "waiting"}
    assert all(o.finished_reason.kind == "abort" for o in outs if o.finished_reason)
    assert runner.kv.is_all_free()


def test_eos_stops_and_frees() -> None:
    runner = FakeRunner()
    req = make_req("r", 5, 30)
    eos = expected_outputs(req.origin_input_ids, 30)[4]
    runner.eos_token_ids = (eos,)
    run(Scheduler(SchedulerConfig(enable_overlap=True), runner), [req])
    assert req.output_ids == expected_outputs(req.origin_input_ids, 30, eos=eos)
    assert req.finished_reason is not None and req.finished_reason.kind == "stop"
    assert runner.kv.is_all_free()


# ---- ScheduleBatch.filter_batch / merge_batch keep input_ids aligned --------------------------


def batch_of(n: int, first: int, with_ids: bool) -> ScheduleBatch:
    reqs = [make_req(f"q{first + i}", 2, 2) for i in range(n)]
    ids = torch.arange(first, first + n) if with_ids else None
    return ScheduleBatch(reqs=reqs, input_ids=ids)


def test_filter_keeps_alignment_and_handles_none() -> None:
    b = batch_of(4, 10, True)
    b.filter_batch([3, 1])
    assert [r.rid for r in b.reqs] == ["q13", "q11"]
    assert b.input_ids is not None and b.input_ids.tolist() == [13, 11]
    b.filter_batch([])
    assert b.reqs == [] and b.input_ids is None
    n = batch_of(3, 0, False)
    n.filter_batch([2])
    assert [r.rid for r in n.reqs] == ["q2"] and n.input_ids is None


def test_merge_keeps_alignment_and_handles_none() -> None:
    a, b = batch_of(2, 0, True), batch_of(2, 5, True)
    a.merge_batch(b)
    assert [r.rid for r in a.reqs] == ["q0", "q1", "q5", "q6"]
    assert a.input_ids is not None and a.input_ids.tolist() == [0, 1, 5, 6]
    empty = ScheduleBatch()
    empty.merge_batch(batch_of(2, 7, True))  # empty side's None is irrelevant
    assert empty.input_ids is not None and empty.input_ids.tolist() == [7, 8]
    full = batch_of(2, 0, True)
    full.merge_batch(ScheduleBatch())
    assert full.input_ids is not None and full.input_ids.tolist() == [0, 1]
    both_none = batch_of(1, 0, False)
    both_none.merge_batch(batch_of(1, 1, False))
    assert len(both_none) == 2 and both_none.input_ids is None
    with pytest.raises(ValueError, match="right batch has requests but no input_ids"):
        batch_of(1, 0, True).merge_batch(batch_of(1, 1, False))
    with pytest.raises(ValueError, match="left batch"):
        batch_of(1, 0, False).merge_batch(batch_of(1, 1, True))


# ---- FutureMap ----------------------------------------------------------------------------


def test_future_map_resolves_placeholders_and_keeps_real_tokens() -> None:
    fm = FutureMap(max_batch=4)
    idx = fm.alloc(3)
    assert bool((idx >= 1).all())
    fm.store(idx, torch.tensor([100, 200, 300]))
    mixed = torch.cat([-idx, torch.tensor([7, 0])])
    assert fm.resolve_future(mixed).tolist() == [100, 200, 300, 7, 0]
    assert fm.resolve_future(torch.tensor([1, 2])).tolist() == [1, 2]


def test_future_map_wraps_without_handing_out_zero() -> None:
    fm = FutureMap(max_batch=2)
    seen = [fm.alloc(2) for _ in range(20)]
    assert all(int(i.min()) >= 1 and int(i.max()) < fm.size for i in seen)
    with pytest.raises(ValueError):
        fm.alloc(fm.size)


def test_fake_runner_notices_corrupted_kv() -> None:
    """Guard for the tests above: misplaced KV must change the fake's tokens."""
    runner = FakeRunner()
    sched = Scheduler(SchedulerConfig(enable_overlap=False), runner)
    req = make_req("r", 6, 10)
    sched.add_request(req)
    for _ in range(4):
        sched.step()
    assert req.kv.row is not None
    row = runner.kv.req_to_token.table[req.kv.row]
    row[0], row[1] = row[1].clone(), row[0].clone()  # swap two positions' slots
    run(sched, [])
    with pytest.raises(AssertionError):
        assert_correct([req])


@pytest.mark.parametrize("seed", range(FUZZ_SEEDS))
def test_randomized_arrivals_aborts_and_tiny_kv(seed: int) -> None:
    """Requests arrive and get aborted at random over a pool too small for all of them."""
    rng = random.Random(seed)
    runner = FakeRunner(num_pages=24, page_size=4, max_reqs=6)
    config = SchedulerConfig(
        enable_overlap=seed % 2 == 0, chunked_prefill_size=rng.choice([8, 16, 64]), max_running_requests=6
    )
    sched = Scheduler(config, runner)
    reqs = [make_req(f"r{i}", rng.randrange(1, 40), rng.randrange(1, 40), seed=i) for i in range(30)]
    churn(sched, reqs, rng, abort_p=0.03, steps=5000)
    assert runner.kv.is_all_free()
    sched.shutdown()


def churn(sched: Scheduler, reqs: list[Req], rng: random.Random, abort_p: float,
          steps: int) -> None:
    """Feed `reqs` in at random, abort live ones at random, run to the end; then every request
    reported one finish, the unaborted ones are exact and the aborted ones a correct prefix."""
    pending, aborted, finished = list(reqs), set(), set()
    for _ in range(steps):
        if pending and rng.random() < 0.3:
            sched.add_request(pending.pop(0))
        if rng.random() < abort_p:
            live = [r for r in reqs if r not in pending and not r.finished]
            if live:
                victim = rng.choice(live)
                assert sched.abort(victim.rid)
                aborted.add(victim.rid)
        finished |= {o.rid for o in sched.step() if o.finished}
        if not pending and not sched.has_work():
            break
    assert not sched.has_work() and not pending
    assert finished == {r.rid for r in reqs}, "every request reports exactly one finish"
    assert_correct([r for r in reqs if r.rid not in aborted])
    for r in reqs:  # aborted ones hold a correct prefix of their tokens
        want = expected_outputs(r.origin_input_ids, r.sampling_params.max_new_tokens)
        assert r.output_ids == want[: len(r.output_ids)]


def test_a_long_chunked_prompt_never_laps_the_future_map() -> None:
    """Overlap: a running request's next token waits in a FutureMap slot while a long prompt is
    prefilled chunk by chunk (prefill goes first, so no decode step resolves it meanwhile).
    Once its forward is done the token must leave the ring (FutureMap.settle), or the ring
    (4 x max_running_requests slots) laps during the chunks and overwrites it."""
    runner = FakeRunner(num_pages=256, page_size=4, max_reqs=2, context_len=512)
    config = SchedulerConfig(max_running_requests=2, chunked_prefill_size=4, enable_overlap=True)
    sched = Scheduler(config, runner)
    first = make_req("first", 5, 12)
    sched.add_request(first)
    for _ in range(4):
        sched.step()
    long = make_req("long", 120, 3, seed=1)  # 30 chunks of 4: far more than the ring's 9 slots
    run(sched, [long])
    assert_correct([first, long])
    assert runner.kv.is_all_free()
    sched.shutdown()


def test_requests_wait_for_a_request_slot_held_outside_the_batch() -> None:
    """Slots held by requests the scheduler does not run (a prefill's handed-off requests
    until their KV is sent, a decode's rooms while KV arrives) are not there to take: new
    requests wait for one instead of crashing the scheduler ("no free request slot")."""
    runner = FakeRunner(max_reqs=4)
    sched = Scheduler(SchedulerConfig(max_running_requests=4), runner)
    held = [runner.kv.req_to_token.alloc() for _ in range(3)]  # as handed-off requests hold
    reqs = [make_req(f"r{i}", 6, 3, seed=i) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(50):
        sched.step()
    assert sum(r.finished for r in reqs) == 5  # one at a time, through the one free slot
    for row in held:
        runner.kv.req_to_token.free(row)
    assert runner.kv.is_all_free()
    for r in reqs:
        assert r.output_ids == expected_outputs(r.origin_input_ids, 3)
