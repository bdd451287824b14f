"""The scheduler's figures for the P:D planner (runtime/figures.py), on the fake runner: requests
received, the prompt tokens each prefill computed (a cached prefix not counted, a chunked or
retracted prompt once), the outputs of requests that finished here (not aborted, not handed
over), and the forwards by mode with their tokens and busy seconds, with overlap and without."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from runtime.config import SchedulerConfig
from runtime.forward_batch import ForwardBatch, ForwardOutput
from runtime.scheduler.req import Req
from runtime.scheduler.scheduler import Scheduler
from tests.scheduler.fake_runner import FakeRunner
from tests.scheduler.test_prebuilt import run_pd
from tests.scheduler.test_scheduler import make_req, run

FORWARD_S = 0.003  # every forward of the slow runner takes at least this long


class SlowRunner(FakeRunner):
    def forward_batch(self, batch: ForwardBatch) -> ForwardOutput:
        time.sleep(FORWARD_S)
        return super().forward_batch(batch)


def moments(lengths: list[int]) -> tuple[int, int, int]:
    return len(lengths), sum(lengths), sum(x * x for x in lengths)


def until(sched: Scheduler, done: Callable[[], bool]) -> None:
    for _ in range(1000):
        if done():
            return
        sched.step()
    raise AssertionError("never")


@pytest.mark.parametrize("overlap", [True, False])
def test_the_tally_counts_what_was_computed(overlap: bool) -> None:
    runner = SlowRunner(num_pages=128, page_size=4, prefix_cache=True)
    sched = Scheduler(SchedulerConfig(enable_overlap=overlap, chunked_prefill_size=16), runner)
    began = time.monotonic()
    long, aborted = make_req("a", 40, 6), make_req("c", 12, 50, seed=2)  # a: in 3 chunks
    for req in (long, make_req("b", 9, 4, seed=1), aborted):
        sched.add_request(req)
    until(sched, lambda: len(aborted.output_ids) >= 2)
    assert sched.abort("c")
    run(sched, [])
    again = Req("d", list(long.origin_input_ids), long.sampling_params)  # its prefix is cached
    run(sched, [again])
    wall = time.monotonic() - began

    f = sched.figures
    assert f.received == 4
    assert again.cached_tokens > 0
    assert (f.prompts.n, f.prompts.sum, f.prompts.sumsq) == moments([40, 9, 12, 40 - again.cached_tokens])
    assert (f.outputs.n, f.outputs.sum, f.outputs.sumsq) == moments([6, 4, 6])  # not the aborted
    for mode in ("extend", "decode"):
        ran = [b for b in runner.batches if b.mode == mode]
        assert f.forwards[mode].count == len(ran) > 0
        assert f.forwards[mode].tokens == sum(sum(b.extend_lens) for b in ran)
    assert f.forwards["decode"].tokens == sum(b.batch_size for b in runner.batches
                                              if b.mode == "decode")
    busy = sum(t.seconds for t in f.forwards.values())
    count = sum(t.count for t in f.forwards.values())
    # each forward's run lies within its busy stretch, and the stretches never overlap
    assert count * FORWARD_S <= busy <= wall
    sched.shutdown()


def test_a_retracted_prompt_counts_once() -> None:
    runner = FakeRunner(num_pages=12, page_size=4)  # 48 tokens for 4 requests wanting 100
    sched = Scheduler(SchedulerConfig(enable_overlap=False), runner)
    run(sched, [make_req(f"r{i}", 5, 20, seed=i) for i in range(4)])
    assert sched.decode.num_retractions > 0
    f = sched.figures
    assert (f.received, f.prompts.n, f.prompts.sum, f.outputs.n, f.outputs.sum) == (4, 4, 20, 4, 80)


def test_prefill_counts_prompts_and_decode_counts_outputs() -> None:
    """PD: the prefill received and prefilled every prompt and finished nothing here; the decode
    received nothing to prefill (its requests come prebuilt) and finished every output."""
    pair = run_pd(4, overlap=False)
    prefill, decode, handoff = pair.prefill, pair.decode, pair.handoff
    assert len(handoff.delivered) == 4
    p, d = prefill.figures, decode.figures
    assert (p.received, p.prompts.n, p.prompts.sum, p.outputs.n) == (4, 4, 3 + 10 + 17 + 24, 0)
    assert p.forwards["decode"].count == 0 and p.forwards["extend"].count > 0
    assert (d.received, d.prompts.n, d.outputs.n, d.outputs.sum) == (0, 0, 4, 5 + 6 + 7 + 8)
    assert d.forwards["extend"].count == 0 and d.forwards["decode"].count > 0
