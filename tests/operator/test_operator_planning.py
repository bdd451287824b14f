"""The P:D planner in the operator (issue 39, item 4): the spec's targets and mode, what the
builders render under `mode: planner`, the step rule (cooldown, no flapping), one service's
decision from a router's figures, and the operator's /debug/planner. Pure functions and a
real HTTP server; the live path (router figures from real workers, the pools following) runs
in tests/e2e/test_planner.py."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest
from baton_operator.builders import (
    autoscaling_condition,
    build_deployment,
    build_hpa,
    build_scaled_object,
)
from baton_operator.capabilities import Capabilities
from baton_operator.metrics import OperatorMetrics
from baton_operator.planning import Figures, History, Planning, step
from baton_operator.spec import InferenceService, InvalidSpec, parse_service
from baton_operator.status import compute_status

from tests.operator.test_operator_builders import UID
from tests.ports import free_port

KEDA = Capabilities(keda=True, custom_metrics=True, prometheus_url="http://prom:9090")
POOLS = {"prefill": {"min": 1, "max": 4}, "decode": {"min": 1, "max": 3}}
PLANNER = {"mode": "planner", "ttftTarget": 500, "itlTarget": 60, "cooldownSeconds": 30, **POOLS}
# what a router's GET /debug/planner says (runtime/router/figures.py)
STEADY = {"rate": 2.0, "prompt_tokens": {"mean": 400, "second": 400 ** 2, "count": 120},
          "output_tokens": {"mean": 40, "second": 1600, "count": 120},
          "prefill_tokens_per_s": 2000.0, "decode_steps": [[2, 0.030], [4, 0.034], [8, 0.042]],
          "decode_kv_tokens": 8192, "window_s": 60, "ready": {"prefill": 1, "decode": 1},
          "missing": []}


def service(autoscaling: dict[str, Any], status: dict[str, Any] | None = None
            ) -> InferenceService:
    body: dict[str, Any] = {"metadata": {"name": "llm", "namespace": "ml", "uid": UID},
                            "spec": {"model": {"uri": "builtin:smollm2-135m"},
                                     "autoscaling": autoscaling}}
    if status is not None:
        body["status"] = status
    return parse_service(body)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the spec --------------------------------------------------------------------------------

def test_targets_alone_recommend_and_mode_planner_enacts() -> None:
    recommend = service({"ttftTarget": 800, "itlTarget": 100})
    assert recommend.planner is not None and not recommend.planner_scaled
    assert (recommend.planner.ttft_ms, recommend.planner.itl_ms) == (800, 100)
    assert recommend.planner.cooldown_s == 120  # the default
    enact = service(PLANNER)
    assert enact.planner_scaled and enact.planner is not None and enact.planner.cooldown_s == 30
    assert service(POOLS).planner is None  # no targets: no planner


@pytest.mark.parametrize(("autoscaling", "match"), [
    ({"mode": "planner", **POOLS}, r"mode planner needs spec\.autoscaling\.ttftTarget, "
                                   r"spec\.autoscaling\.itlTarget"),
    ({"mode": "planner", "ttftTarget": 1, "itlTarget": 1, "prefill": POOLS["prefill"]},
     r"needs spec\.autoscaling\.decode"),
    ({"ttftTarget": 500}, r"both ttftTarget and itlTarget"),
    ({"mode": "auto"}, r"spec\.autoscaling\.mode"),
    ({"ttftTarget": 0, "itlTarget": 10}, r"spec\.autoscaling\.ttftTarget"),
    ({"cooldownSeconds": -1}, r"spec\.autoscaling\.cooldownSeconds"),
    ({"queue": {"min": 1, "max": 2}}, r"only prefill and decode pools autoscale"),
])
def test_a_planner_spec_that_cannot_work_names_its_field(autoscaling: dict[str, Any],
                                                         match: str) -> None:
    with pytest.raises(InvalidSpec, match=match):
        service(autoscaling)


def test_enacted_replicas_come_from_the_status_within_min_and_max() -> None:
    fresh = service(PLANNER)
    assert [fresh.planned_replicas(r) for r in ("prefill", "decode")] == [1, 1]
    planned = service(PLANNER, {"planner": {"prefill": {"replicas": 3},
                                            "decode": {"replicas": 9}}})
    assert [planned.planned_replicas(r) for r in ("prefill", "decode")] == [3, 3]  # max 3
    mangled = service(PLANNER, {"planner": {"prefill": {"replicas": "two"}, "decode": []}})
    assert mangled.planned == {}


# -- what the builders render ----------------------------------------------------------------

def test_under_the_planner_the_deployments_carry_its_replicas_and_nothing_else_scales() -> None:
    svc = service(PLANNER, {"planner": {"prefill": {"replicas": 2}, "decode": {"replicas": 3}}})
    for role, replicas in (("prefill", 2), ("decode", 3)):
        assert build_deployment(svc, role, KEDA)["spec"]["replicas"] == replicas
        assert build_hpa(svc, role, KEDA) is None
        assert build_scaled_object(svc, role, KEDA) is None
    assert build_deployment(svc, "router", KEDA)["spec"]["replicas"] == 1
    condition = autoscaling_condition(svc, Capabilities())
    assert condition is not None and (condition["status"], condition["reason"]) == ("True",
                                                                                  "Planner")
    assert "prefill 1..4, decode 1..3" in condition["message"]
    assert "TTFT of 500 ms and an ITL of 60 ms" in condition["message"]
    # targets with mode metrics: the pools' own scalers stay
    metrics = service({"ttftTarget": 500, "itlTarget": 60, **POOLS})
    assert build_scaled_object(metrics, "prefill", KEDA) is not None


# -- the step rule ---------------------------------------------------------------------------

def run(plans: list[int], start: int, cooldown: float, every: float = 5.0) -> list[int]:
    """The replicas after each plan, one plan every `every` seconds."""
    history, now, current, out = History(), 0.0, start, []
    for n in plans:
        now += every
        history.add(now, n, keep_s=cooldown * 2)
        enacted, _ = step(current, n, history, now, cooldown)
        if enacted != current:
            history.changed = now
        current = enacted
        out.append(current)
    return out


def test_a_pool_goes_up_at_once_and_down_only_after_a_cooldown_of_lower_plans() -> None:
    assert run([3], start=1, cooldown=30) == [3]
    # down: plans of 1 over a whole 30 s (t = 10..40) before it shrinks
    assert run([3, 1, 1, 1, 1, 1, 1, 1], start=1, cooldown=30) == [3, 3, 3, 3, 3, 3, 3, 1]
    assert run([3, 2, 1, 1, 1, 1, 1, 1], start=1, cooldown=30)[-1] == 2


def test_a_pool_changes_at_most_once_per_cooldown() -> None:
    assert run([2, 3, 4, 4, 4, 4, 4], start=1, cooldown=30) == [2, 2, 2, 2, 2, 2, 4]


def test_a_load_between_two_counts_settles_on_the_higher_one() -> None:
    """Noise that makes the plan alternate between 2 and 3 moves the pool once, to 3, and
    never back: no flapping."""
    out = run([2, 3] * 40, start=2, cooldown=30)
    assert out[1:] == [3] * (len(out) - 1)


# -- one service's decision -------------------------------------------------------------------

def test_a_decision_publishes_the_plan_and_steps_the_pools() -> None:
    clock = Clock()
    planning = Planning(clock)
    svc = service(PLANNER)
    decision = planning.decide(svc, Figures(STEADY, "http://10.0.0.9:8000/debug/planner"))
    assert decision.recommended["prefill"] >= 1 and decision.recommended["decode"] >= 1
    assert decision.status["recommended"] == "{prefill}:{decode}".format(**decision.recommended)
    assert decision.replicas == decision.recommended  # up from 1 at once
    assert decision.status["prefill"]["met"] is True and "TTFT" in decision.status["prefill"]["why"]
    assert planning.explained["ml/llm"]["figures"]["rate"] == 2.0
    # a prompt twice as long doubles the prefill work: more prefill pods, the same decodes
    heavy = {**STEADY, "prompt_tokens": {"mean": 1600, "second": 1600 ** 2, "count": 120}}
    more = Planning(clock).decide(svc, Figures(heavy, "x"))
    assert more.recommended["prefill"] > decision.recommended["prefill"]
    assert more.recommended["decode"] == decision.recommended["decode"]


def test_without_figures_the_pools_stay_and_the_status_says_why() -> None:
    svc = service(PLANNER, {"planner": {"prefill": {"replicas": 2}, "decode": {"replicas": 1}}})
    planning = Planning(Clock())
    decision = planning.decide(svc, Figures(None, "", "no router pod is ready"))
    assert decision.replicas == {"prefill": 2, "decode": 1} and decision.recommended == {}
    assert "no router pod is ready" in decision.status["message"]
    partial = {**STEADY, "decode_steps": [], "missing": ["no decode step measured yet"]}
    decision = planning.decide(svc, Figures(partial, "x"))
    assert "decode_steps" in decision.status["message"]
    assert "no decode step measured yet" in decision.status["message"]


def test_with_no_requests_the_plan_is_each_pools_min() -> None:
    svc = service(PLANNER, {"planner": {"prefill": {"replicas": 3}, "decode": {"replicas": 2}}})
    idle = {**STEADY, "rate": 0.0, "decode_steps": [], "prefill_tokens_per_s": None}
    decision = Planning(Clock()).decide(svc, Figures(idle, "x"))
    assert decision.recommended == {"prefill": 1, "decode": 1}
    assert decision.replicas == {"prefill": 3, "decode": 2}  # shrinking waits a cooldown


def test_the_operator_serves_its_explanation_and_the_recommendation_metric() -> None:
    metrics, planning = OperatorMetrics(), Planning(Clock())
    decision = planning.decide(service(PLANNER), Figures(STEADY, "http://r:8000/debug/planner"))
    metrics.set_recommended("ml", "llm", decision.recommended)
    metrics.explain = lambda: planning.explained
    port = free_port()
    server = metrics.serve(port)
    assert server is not None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/debug/planner", timeout=5) as r:
            explained = json.loads(r.read())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert explained["ml/llm"]["source"] == "http://r:8000/debug/planner"
    assert explained["ml/llm"]["plans"]["decode"]["replicas"] == decision.recommended["decode"]
    line = ('baton_recommended_replicas{name="llm",namespace="ml",role="prefill"} '
            f'{float(decision.recommended["prefill"])}')
    assert line in text


def test_the_plan_leaves_the_status_with_its_targets() -> None:
    """Targets removed: the next pass clears status.planner (no stale RECOMMENDED)."""
    previous = {"planner": {"recommended": "2:1"}}
    gone = compute_status(service({}), {}, previous, 1)
    assert gone["planner"] is None
    kept = compute_status(service(PLANNER), {}, previous, 1)
    assert "planner" not in kept  # the planner's own status write owns it
