"""The prefill pool's load signal: prompt tokens of the waiting requests, from the scheduler to
`baton_queued_prompt_tokens` (the autoscaler's default for prefill pools, issue 28)."""

from __future__ import annotations

from runtime.config import SchedulerConfig
from runtime.messages import SchedulerStats
from runtime.scheduler.scheduler import Scheduler
from runtime.server.metrics import Metrics
from tests.scheduler.fake_runner import FakeRunner
from tests.scheduler.test_scheduler import make_req
from tests.server.test_metrics import metric


def test_waiting_prompts_count_until_they_are_admitted() -> None:
    sched = Scheduler(SchedulerConfig(enable_overlap=False, chunked_prefill_size=16),
                      FakeRunner(num_pages=64))
    assert sched.queued_prompt_tokens() == 0
    for i, n in enumerate((5, 7, 11)):
        sched.add_request(make_req(f"r{i}", n, 2, seed=i))
    assert sched.queued_prompt_tokens() == 23
    sched.step()  # a 16-token chunk: the first two join; the third is cut, the rest waits
    assert 0 <= sched.queued_prompt_tokens() < 23
    while sched.has_work():
        sched.step()
    assert sched.queued_prompt_tokens() == 0


def test_the_gauge_follows_the_scheduler_stats() -> None:
    metrics = Metrics()
    metrics.set_stats(SchedulerStats(num_waiting=2, queued_prompt_tokens=4096))
    text = metrics.render().decode()
    assert metric(text, "baton_queued_prompt_tokens") == 4096
    metrics.set_stats(SchedulerStats())
    assert metric(metrics.render().decode(), "baton_queued_prompt_tokens") == 0
