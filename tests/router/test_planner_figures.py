"""The router's P:D planner figures (runtime/router/figures.py) from synthetic /ready bodies: the
window's differences, a restarted worker's history starting over, a worker that left, malformed
figures ignored, null fields with the reason, and the JSON `baton_operator.planner.figures_from`
reads."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from runtime.figures import ServingFigures
from runtime.router.config import Role
from runtime.router.figures import MAX_STEPS, PlannerFigures

READY: dict[Role, int] = {"prefill": 1, "decode": 1}


class Worker:
    """A worker's totals, grown step by step, and the /ready body that shows them."""

    def __init__(self, kv_tokens: int = 4096) -> None:
        self.figures, self.kv_tokens = ServingFigures(), kv_tokens

    def prefill(self, *prompts: int, seconds: float = 0.1) -> Worker:
        for n in prompts:
            self.figures.received += 1
            self.figures.prompts.add(n)
            self.figures.forwards["extend"].add(n, seconds)
        return self

    def decode(self, batch: int, steps: int, step_s: float, *outputs: int) -> Worker:
        for _ in range(steps):
            self.figures.forwards["decode"].add(batch, step_s)
        for n in outputs:
            self.figures.outputs.add(n)
        return self

    def body(self) -> dict[str, Any]:
        return {"status": "ready", "figures": {**dataclasses.asdict(self.figures),
                                               "kv_tokens": self.kv_tokens}}


def test_the_window_takes_differences_over_each_worker_s_history() -> None:
    planner, p, d = PlannerFigures(window_s=60), Worker().prefill(1000), Worker(kv_tokens=9000)
    planner.observe("prefill", "http://p", p.body(), at=0)  # before: not in the figures
    planner.observe("decode", "http://d", d.body(), at=0)
    p.prefill(100, 300, seconds=0.2)
    d.decode(4, 10, 0.02, 20, 20)
    planner.observe("prefill", "http://p", p.body(), at=10)
    planner.observe("decode", "http://d", d.body(), at=10)
    d.decode(2, 5, 0.01, 20)
    planner.observe("decode", "http://d", d.body(), at=20)
    view = planner.view(READY, now=20)
    assert view["rate"] == pytest.approx(2 / 10)
    assert view["prompt_tokens"] == {"mean": 200, "second": (100**2 + 300**2) / 2, "count": 2}
    assert view["output_tokens"] == {"mean": 20, "second": 400, "count": 3}
    assert view["prefill_tokens_per_s"] == pytest.approx(400 / 0.4)
    assert view["decode_steps"] == [[4, pytest.approx(0.02)], [2, pytest.approx(0.01)]]
    assert view["decode_kv_tokens"] == 9000
    assert (view["window_s"], view["ready"], view["missing"]) == (20, READY, [])


def test_old_snapshots_leave_the_window() -> None:
    planner, p = PlannerFigures(window_s=30), Worker()
    for t in range(0, 100, 10):  # one prompt of 10 * t tokens every 10 s
        planner.observe("prefill", "http://p", p.prefill(t + 10).body(), at=t)
    view = planner.view(READY, now=90)
    assert view["window_s"] == 30  # the polls at 60, 70, 80, 90
    assert view["prompt_tokens"]["mean"] == (80 + 90 + 100) / 3
    assert view["rate"] == pytest.approx(3 / 30)
    assert planner.view(READY, now=200)["rate"] is None  # nothing answered lately


def test_a_restarted_worker_starts_over_and_one_that_left_is_gone() -> None:
    planner, p, other = PlannerFigures(), Worker().prefill(50, 50), Worker()
    planner.observe("prefill", "http://p", p.body(), at=0)
    planner.observe("prefill", "http://p", p.prefill(50).body(), at=1)
    restarted = Worker().prefill(7)  # its counters went down: a new server at the same URL
    planner.observe("prefill", "http://p", restarted.body(), at=2)
    planner.observe("prefill", "http://p", restarted.prefill(9).body(), at=4)
    planner.observe("prefill", "http://q", other.body(), at=0)
    planner.observe("prefill", "http://q", other.prefill(11).body(), at=1)
    view = planner.view(READY, now=4)
    assert view["prompt_tokens"]["count"] == 2 and view["prompt_tokens"]["mean"] == 10
    assert view["rate"] == pytest.approx(1 / 2 + 1 / 1)  # each worker over its own span
    planner.forget("http://q")
    assert planner.view(READY, now=4)["prompt_tokens"]["mean"] == 9


@pytest.mark.parametrize("body", [
    {"status": "ready"}, [], "ready", {"figures": []}, {"figures": {"received": 1}},
    {"figures": {**dataclasses.asdict(ServingFigures()), "received": -1}},
    {"figures": {**dataclasses.asdict(ServingFigures()), "received": 1.5}},
    {"figures": {**dataclasses.asdict(ServingFigures()), "forwards": {"extend": {}}}},
    {"figures": {**dataclasses.asdict(ServingFigures()), "prompts": {"n": "1", "sum": 0,
                                                                     "sumsq": 0}}},
])
def test_malformed_figures_are_ignored(body: Any) -> None:
    planner, p = PlannerFigures(), Worker()
    planner.observe("prefill", "http://p", p.body(), at=0)
    planner.observe("prefill", "http://p", body, at=1)  # ignored: no restart, no snapshot
    planner.observe("prefill", "http://p", p.prefill(8).body(), at=2)
    assert planner.view(READY, now=2)["prompt_tokens"]["mean"] == 8


def test_no_data_is_null_with_the_reason() -> None:
    planner, d = PlannerFigures(window_s=60), Worker(kv_tokens=0)
    view = planner.view(dict.fromkeys(READY, 0), now=0)
    assert {k for k, v in view.items() if v is None} == {
        "rate", "prompt_tokens", "output_tokens", "prefill_tokens_per_s", "decode_steps",
        "decode_kv_tokens"}
    assert len(view["missing"]) == 6 and "decode_steps: no decode worker ran" in view["missing"][4]
    planner.observe("decode", "http://d", d.body(), at=0)
    planner.observe("decode", "http://d", d.body(), at=5)
    view = planner.view(READY, now=5)
    assert view["rate"] == 0 and view["decode_kv_tokens"] is None  # (a KV pool of 0: not shown)


def test_the_decodes_extends_count_only_without_prefill_figures() -> None:
    planner, p, d = PlannerFigures(), Worker(), Worker()
    planner.observe("decode", "http://d", d.body(), at=0)
    planner.observe("decode", "http://d", d.prefill(500, seconds=1.0).body(), at=1)
    assert planner.view(READY, now=1)["prefill_tokens_per_s"] == 500  # a local prefill
    planner.observe("prefill", "http://p", p.body(), at=0)
    planner.observe("prefill", "http://p", p.prefill(100, seconds=0.1).body(), at=1)
    assert planner.view(READY, now=1)["prefill_tokens_per_s"] == pytest.approx(1000)


def test_the_newest_decode_steps_only() -> None:
    planner, d = PlannerFigures(window_s=1000), Worker()
    planner.observe("decode", "http://d", d.body(), at=0)
    for t in range(1, MAX_STEPS + 11):
        planner.observe("decode", "http://d", d.decode(t, 1, 0.01).body(), at=t)
    steps = planner.view(READY, now=MAX_STEPS + 10)["decode_steps"]
    assert len(steps) == MAX_STEPS and steps[0][0] == 11 and steps[-1][0] == MAX_STEPS + 10


def test_the_operator_s_planner_reads_the_view() -> None:
    """The operator GETs /debug/planner and adds its targets: `figures_from` takes the rest."""
    planner = pytest.importorskip("baton_operator.planner")
    figures, p, d = PlannerFigures(), Worker(), Worker(kv_tokens=100_000)
    figures.observe("prefill", "http://p", p.body(), at=0)
    figures.observe("decode", "http://d", d.body(), at=0)
    figures.observe("prefill", "http://p", p.prefill(900, 1100, seconds=0.25).body(), at=2)
    figures.observe("decode", "http://d", d.decode(8, 100, 0.02, 50, 150).body(), at=2)
    view = figures.view(READY, now=2)
    load, measured, _ = planner.figures_from({**view, "ttft_target_s": 1, "itl_target_s": 0.1})
    assert (load.rate, load.prompt.mean, load.output.mean) == (1.0, 1000, 100)
    assert measured.prefill_tokens_per_s == 4000 and measured.decode_kv_tokens == 100_000
    assert measured.decode_steps == ((8, pytest.approx(0.02)),)
    plan = planner.plan(*planner.figures_from({**view, "ttft_target_s": 1, "itl_target_s": 0.1}))
    assert plan["prefill"].met and plan["decode"].met


def test_a_window_in_which_no_request_finished_keeps_the_last_lengths_seen() -> None:
    """Under a decode backlog every stream outlives the window: the output lengths (the
    workload's) carry over from the last window that saw some, marked stale with their age."""
    planner, d = PlannerFigures(window_s=10), Worker()
    planner.observe("decode", "http://d", d.body(), at=0)
    planner.observe("decode", "http://d", d.decode(4, 10, 0.02, 30, 50).body(), at=5)
    fresh = planner.view(READY, now=5)
    assert fresh["output_tokens"]["mean"] == 40 and fresh["stale"] == {}
    for t in (20, 25):  # steps, but nothing finishes
        planner.observe("decode", "http://d", d.decode(8, 50, 0.04).body(), at=t)
    later = planner.view(READY, now=25)
    assert later["output_tokens"] == fresh["output_tokens"]
    assert later["stale"] == {"output_tokens": 20}
    assert not any(m.startswith("output_tokens") for m in later["missing"])
    assert later["decode_steps"] == [[8, pytest.approx(0.04)]]
    assert PlannerFigures().view(READY, now=0)["output_tokens"] is None  # nothing seen yet
