"""A running decode batch keeps its rows' sampling parameters, table rows and what they asked
back (`batch.Rows`) from step to step, and builds them anew whenever its rows change: every
forward's sampling rows still belong to exactly its requests, in order."""

from __future__ import annotations

import itertools
import random

import pytest

from runtime.config import SchedulerConfig
from runtime.sampling_params import SamplingParams
from runtime.scheduler.req import Req
from runtime.scheduler.scheduler import Scheduler
from tests.scheduler.fake_runner import FakeRunner


def req(i: int, max_new: int) -> Req:
    rng = random.Random(i)
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0 if i % 2 else 0.5 + i / 10,
                            top_k=1 + i, seed=100 + i, repetition_penalty=1.0 + i / 20)
    return Req(f"r{i}", [rng.randrange(1000) for _ in range(3 + i)], params,
               return_logprob=i == 3, top_logprobs_num=2 if i == 3 else 0)


@pytest.mark.parametrize("overlap", [False, True])
def test_every_forward_samples_its_own_rows(overlap: bool) -> None:
    runner = FakeRunner()
    sched = Scheduler(SchedulerConfig(enable_overlap=overlap), runner)
    reqs = [req(i, 4 + 3 * i) for i in range(4)]  # they finish at different steps
    for r in reqs[:3]:
        sched.add_request(r)
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        if steps == 6:
            sched.add_request(reqs[3])  # joins the running batch mid-way
    by_seed = {r.seed: r for r in reqs}
    decodes = [b for b in runner.batches if b.mode == "decode"]
    reused = rebuilt = 0
    for prev, b in itertools.pairwise(decodes):
        if b.sampling.temperatures is prev.sampling.temperatures:  # kept from the last step
            reused += 1
            assert b.req_pool_indices.tolist() == prev.req_pool_indices.tolist()
        else:
            rebuilt += 1
    for b in decodes:
        info = b.sampling
        assert info.sample_positions.tolist() == b.seq_lens  # this step's, never kept
        rows = [by_seed[s] for s in info.seeds.tolist()]  # each row's request, by its seed
        assert len(rows) == b.batch_size
        for k, r in enumerate(rows):
            p = r.sampling_params
            assert info.temperatures[k].item() == pytest.approx(0.0 if p.is_greedy else p.temperature)
            assert info.top_ks[k].item() == p.top_k
            assert info.repetition_penalties is not None
            assert info.repetition_penalties[k].item() == pytest.approx(p.repetition_penalty)
        assert b.return_logprob == any(r.return_logprob for r in rows)
        assert b.top_logprobs_num == max(r.top_logprobs_num for r in rows)
    assert reused > 0 and rebuilt > 0, (reused, rebuilt)
    assert runner.kv.is_all_free()
    sched.shutdown()
