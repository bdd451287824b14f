"""Coordinated rollouts (operator/baton_operator/rollout.py, issue 39 item 2): the plan for the
worker Deployments of two revisions, pass by pass, and the children it shapes.

The plan is a pure function of the live Deployments, so these tests drive it as the cluster
would: a simulated cluster applies each plan, then pods start, turn ready or leave one at a
time in a random order, and after every event the ready share of new-revision pods in the two
pools must stay within one step of each other (maxSkew, or one pod of the smaller pool).
"""

from __future__ import annotations

import datetime
import random
from dataclasses import replace
from typing import Any

import pytest
from baton_operator.builders import build_children, optional_children
from baton_operator.builders.cluster_key import operator_token
from baton_operator.builders.pods import spec_revision
from baton_operator.builders.workloads import PROBE_ARGS, build_probe_deployment
from baton_operator.kube import Kube
from baton_operator.probing import Gate, run_gate
from baton_operator.rollout import (
    PROBE_FAILED,
    PROBING,
    ROLLING,
    STABLE,
    Decision,
    Live,
    new_at,
    plan,
    sizes,
    steps,
)
from baton_operator.spec import InferenceService, InvalidSpec, parse_service
from baton_operator.status import rollout_event

from runtime.auth.key import ClusterKey
from tests.kube.isvc_helpers import NAMESPACE, Cluster

REV = "aaaaaaaaaaaa"
OLD = "bbbbbbbbbbbb"


def service(**spec: Any) -> InferenceService:
    spec.setdefault("model", {"uri": "builtin:smollm2-135m"})
    return parse_service({"metadata": {"name": "llm", "namespace": "ml", "uid": "u"},
                          "spec": spec})


def live(role: str, revision: str, desired: int, pods: int | None = None,
         ready: int | None = None, created: str = "1") -> Live:
    pods = desired if pods is None else pods
    return Live(f"llm-{role}-{revision}", revision, desired, pods,
                pods if ready is None else ready, created)


def serving(n_prefill: int = 2, n_decode: int = 2) -> dict[str, list[Live]]:
    return {"prefill": [live("prefill", OLD, n_prefill)], "decode": [live("decode", OLD, n_decode)]}


PASSED = Gate(REV, "passed", "3 probes exact")


def test_a_first_revision_or_one_already_alone_is_stable() -> None:
    svc = service()
    n = {"prefill": 2, "decode": 2}
    assert plan(svc, REV, {"prefill": [], "decode": []}, n, None).phase == STABLE
    alone = {"prefill": [live("prefill", REV, 2)], "decode": [live("decode", REV, 2)]}
    result = plan(svc, REV, alone, n, None)
    assert (result.phase, result.new, result.old, result.probes) == (STABLE, {}, {}, False)


def test_a_new_revision_is_probed_first_and_a_failed_gate_stops_it() -> None:
    svc = service()
    n = {"prefill": 2, "decode": 2}
    probing = plan(svc, REV, serving(), n, None)
    assert (probing.phase, probing.probes, probing.new, probing.old) == (PROBING, True, {}, {})
    pending = plan(svc, REV, serving(), n, Gate(REV, "pending", "waiting for the decode probe"))
    assert (pending.phase, pending.message) == (PROBING, "waiting for the decode probe")
    failed = plan(svc, REV, serving(), n, Gate(REV, "failed", "probe 1: ... KV canary"))
    assert (failed.phase, failed.probes, failed.new, failed.old) == (PROBE_FAILED, False, {}, {})
    assert failed.message == "probe 1: ... KV canary"
    # a verdict about another revision says nothing about this one
    assert plan(svc, REV, serving(), n, Gate(OLD, "failed", "x")).phase == PROBING
    # without the gate, or when the old revision does not serve, the rollout starts at once
    assert plan(service(rollout={"gate": "none"}), REV, serving(), n, None).phase == ROLLING
    unready = {"prefill": [live("prefill", OLD, 2, ready=0)], "decode": [live("decode", OLD, 2)]}
    assert plan(svc, REV, unready, n, None).phase == ROLLING
    # an older operator's Deployments (`llm-<role>`, no revision in the name) running this
    # very revision: it moves to its new names in step, with nothing to prove
    legacy = {role: [Live(f"llm-{role}", REV, 2, 2, 2, "1")] for role in ("prefill", "decode")}
    moved = plan(svc, REV, legacy, n, None)
    assert (moved.phase, moved.new, moved.old) == (ROLLING, {"prefill": 1, "decode": 1},
                                                   {"llm-prefill": 2, "llm-decode": 2})


def test_steps_of_two_by_two() -> None:
    """2P+2D, maxSkew 50%: two steps, each adds a pod per pool, waits for them, then takes
    an old pod per pool away and waits for it to go; at the end the old ones are deleted."""
    svc, n = service(), {"prefill": 2, "decode": 2}
    pools = serving()
    one = plan(svc, REV, pools, n, PASSED)
    assert (one.phase, one.new, one.step) == (ROLLING, {"prefill": 1, "decode": 1}, (1, 2))
    assert one.old == {"llm-prefill-" + OLD: 2, "llm-decode-" + OLD: 2}
    starting = {r: [*pools[r], live(r, REV, 1, pods=1, ready=0, created="2")] for r in pools}
    assert plan(svc, REV, starting, n, None).new == {"prefill": 1, "decode": 1}
    assert plan(svc, REV, starting, n, None).old == one.old  # nothing leaves before it is ready
    half = {r: [*pools[r], live(r, REV, 1, created="2")] for r in pools}
    shrink = plan(svc, REV, half, n, None)
    assert shrink.new == {"prefill": 1, "decode": 1}  # step 2 waits for the old pods to leave
    assert shrink.old == {"llm-prefill-" + OLD: 1, "llm-decode-" + OLD: 1}
    left = {r: [live(r, OLD, 1), live(r, REV, 1, created="2")] for r in pools}
    two = plan(svc, REV, left, n, None)
    assert (two.new, two.step) == ({"prefill": 2, "decode": 2}, (2, 2))
    done = {r: [live(r, OLD, 0), live(r, REV, 2, created="2")] for r in pools}
    final = plan(svc, REV, done, n, None)
    assert (final.phase, sorted(final.delete)) == (STABLE, ["llm-decode-" + OLD,
                                                             "llm-prefill-" + OLD])
    # a decode still draining holds the deletion back
    draining = {**done, "decode": [live("decode", OLD, 0, pods=1, ready=0),
                                   live("decode", REV, 2, created="2")]}
    assert plan(svc, REV, draining, n, None).delete == []


@pytest.mark.parametrize(("skew", "n", "k"), [(50, (2, 2), 2), (100, (4, 4), 1), (25, (4, 8), 4),
                                               (10, (1, 3), 3), (34, (1, 3), 3), (1, (2, 2), 2)])
def test_the_number_of_steps(skew: int, n: tuple[int, int], k: int) -> None:
    assert steps({"prefill": n[0], "decode": n[1]}, skew) == k


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(("n", "skew"), [((2, 2), 50), ((3, 5), 34), ((1, 4), 25), ((4, 2), 100),
                                          ((6, 6), 20)])
def test_ready_shares_stay_within_a_step_whatever_the_order_pods_move_in(
        seed: int, n: tuple[int, int], skew: int) -> None:
    """A simulated cluster: each event applies the plan to the Deployments, then one pod of
    one of them starts, turns ready, or leaves (a scale-down takes a ready pod away at once,
    its pod leaves later: a draining decode), in a random order. Throughout: never fewer
    ready pods in a pool than it had before the rollout less one step, the new revision's
    ready shares within one step of each other, and it ends with the old revision gone."""
    rng = random.Random(seed)
    svc = service(rollout={"maxSkew": skew, "gate": "none"})
    size = {"prefill": n[0], "decode": n[1]}
    k = steps(size, skew)
    bound = max(1 / k + max(1 / size[r] for r in size), skew / 100)
    deps: dict[str, dict[str, Any]] = {}  # name -> role, revision, desired, pods, ready
    for role, count in size.items():
        deps[f"llm-{role}-{OLD}"] = {"role": role, "rev": OLD, "desired": count, "pods": count,
                                     "ready": count, "created": "1"}
    for _ in range(2000):
        pools = {role: [Live(name, d["rev"], d["desired"], d["pods"], d["ready"], d["created"])
                        for name, d in sorted(deps.items()) if d["role"] == role]
                 for role in size}
        result = plan(svc, REV, pools, size, None)
        for role, count in result.new.items():
            name = f"llm-{role}-{REV}"
            deps.setdefault(name, {"role": role, "rev": REV, "desired": 0, "pods": 0,
                                   "ready": 0, "created": "2"})["desired"] = count
        for name, count in result.old.items():
            d = deps[name]
            d["desired"] = count
            d["ready"] = min(d["ready"], count)  # a pod told to go stops serving at once
        for name in result.delete:
            del deps[name]
        if result.phase == STABLE and not result.new and all(d["rev"] == REV for d in deps.values()):
            break
        moves = [(name, kind) for name, d in deps.items() for kind in ("start", "ready", "leave")
                 if (kind == "start" and d["pods"] < d["desired"])
                 or (kind == "ready" and d["ready"] < min(d["pods"], d["desired"]))
                 or (kind == "leave" and d["pods"] > d["desired"])]
        assert moves, (result, deps)
        name, kind = rng.choice(moves)
        d = deps[name]
        d["pods"] += {"start": 1, "ready": 0, "leave": -1}[kind]
        d["ready"] += kind == "ready"
        for rev in (REV, OLD):  # each revision's ready P:D, the new one's and the old one's
            shares = {role: sum(d["ready"] for d in deps.values()
                                if d["role"] == role and d["rev"] == rev) / size[role]
                      for role in size}
            assert abs(shares["prefill"] - shares["decode"]) <= bound + 1e-9, (rev, shares, deps)
        for role in size:  # capacity: at most one step's pods of a pool out of service
            ready = sum(d["ready"] for d in deps.values() if d["role"] == role)
            assert ready >= size[role] - new_at(1, size[role], k) - 1e-9, (role, deps)
    else:
        raise AssertionError(f"the rollout did not finish: {deps}")
    assert {d["role"]: d["desired"] for d in deps.values()} == size


def test_an_autoscaled_pool_rolls_at_the_size_it_had_when_the_rollout_began() -> None:
    svc = service(autoscaling={"decode": {"min": 2, "max": 6, "metric": "cpu"}})
    pools = {"prefill": [live("prefill", OLD, 1)], "decode": [live("decode", OLD, 5)]}
    assert sizes(svc, pools, REV, {}) == {"prefill": 1, "decode": 5}
    later = {"prefill": pools["prefill"], "decode": [live("decode", OLD, 3), live("decode", REV, 3)]}
    assert sizes(svc, later, REV, {"revision": REV, "replicas": {"decode": 5}})["decode"] == 5
    # a record of another revision's rollout does not count
    assert sizes(svc, later, REV, {"revision": OLD, "replicas": {"decode": 5}})["decode"] == 6


def test_the_children_under_each_phase() -> None:
    svc = service(autoscaling={"decode": {"min": 1, "max": 3, "metric": "cpu"}})
    rev = spec_revision(svc)
    children = build_children(svc)
    names = {(c["kind"], c["metadata"]["name"]) for c in children}
    assert {("Deployment", f"llm-decode-{rev}"), ("HorizontalPodAutoscaler", "llm-decode")} <= names
    n = {"prefill": 1, "decode": 2}

    def shaped(phase: str, **extra: Any) -> dict[tuple[str, str], dict[str, Any]]:
        decision = Decision(replace(plan(svc, rev, {"prefill": [], "decode": []}, n, None),
                                    phase=phase, **extra), None, n)
        return {(c["kind"], c["metadata"]["name"]): c for c in decision.shape(svc, children)}

    probing = shaped(PROBING, probes=True)
    assert ("Deployment", f"llm-decode-{rev}") not in probing  # the new revision waits
    assert ("HorizontalPodAutoscaler", "llm-decode") not in probing  # paused
    probe = probing["Deployment", "llm-decode-probe"]
    assert probe == build_probe_deployment(svc, "decode")
    # once not wanted (the gate decided) the pass deletes them: they are optional children
    assert {("apps/v1", "Deployment", f"llm-{role}-probe") for role in ("prefill", "decode")} <= set(
        optional_children(svc))
    failed = shaped(PROBE_FAILED)
    assert not [k for k in failed if k[0] == "Deployment" and k[1] != "llm-router"]
    rolling = shaped(ROLLING, new={"prefill": 1, "decode": 1})
    assert rolling["Deployment", f"llm-decode-{rev}"]["spec"]["replicas"] == 1
    assert ("HorizontalPodAutoscaler", "llm-decode") not in rolling
    stable = shaped(STABLE)
    assert stable["HorizontalPodAutoscaler", "llm-decode"]["spec"]["scaleTargetRef"]["name"] == (
        f"llm-decode-{rev}")


def test_a_probe_pod_is_its_revisions_pod_with_the_oracle_and_the_canary_and_serves_nobody() -> None:
    svc = service(decode={"args": ["--sampler-backend", "torch"]})
    probe = build_probe_deployment(svc, "decode")
    pool = next(c for c in build_children(svc) if c["metadata"]["name"].startswith("llm-decode-"))
    labels = probe["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "baton-probe"  # no Service or router selects it
    assert labels["baton.dev/revision"] == spec_revision(svc) and labels["baton.dev/role"] == "decode"
    assert probe["spec"]["selector"]["matchLabels"].items() <= labels.items()
    args = probe["spec"]["template"]["spec"]["containers"][0]["args"]
    served = pool["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args == [*served, *PROBE_ARGS]  # last, so the oracle wins over the pool's sampler
    assert probe["spec"]["replicas"] == 1


def test_the_operators_token_is_the_one_the_router_derives() -> None:
    """The operator does not import the runtime: its copy of the derivation must agree."""
    for key in (b"0123456789abcdef0123456789abcdef", b"another key of 16+ bytes"):
        assert operator_token(key) == ClusterKey(key).operator_token()
    assert operator_token(b"k" * 32) != operator_token(b"j" * 32)


@pytest.mark.parametrize(("value", "percent"), [(50, 50), ("50%", 50), ("100%", 100), (1, 1)])
def test_max_skew_is_a_percentage(value: Any, percent: int) -> None:
    assert service(rollout={"maxSkew": value}).rollout.max_skew == percent


@pytest.mark.parametrize("bad", [0, 101, "0%", "50", "x%", True, 2.5])
def test_a_bad_max_skew_names_its_field(bad: Any) -> None:
    with pytest.raises(InvalidSpec, match=r"spec\.rollout\.maxSkew"):
        service(rollout={"maxSkew": bad})


def test_rollout_spec_errors_name_their_field() -> None:
    with pytest.raises(InvalidSpec, match=r"spec\.rollout\.gate"):
        service(rollout={"gate": "maybe"})
    with pytest.raises(InvalidSpec, match=r"spec\.rollout\.probeTimeoutSeconds"):
        service(rollout={"probeTimeoutSeconds": 5})
    with pytest.raises(InvalidSpec, match=r"spec\.rollout\.surprise"):
        service(rollout={"surprise": 1})
    default = service().rollout
    assert (default.max_skew, default.gate, default.probe_timeout_s) == (50, True, 900)


def test_the_gate_and_the_end_of_a_rollout_are_events() -> None:
    def st(**rollout: Any) -> dict[str, Any]:
        return {"rollout": rollout}

    failed = rollout_event(st(revision=REV, phase="Probing", gate="pending"),
                           st(revision=REV, phase="ProbeFailed", gate="failed", message="probe 1"))
    assert failed == ("Warning", "ProbeFailed", f"revision {REV} failed the gate, the old "
                                                "revision keeps serving: probe 1")
    passed = rollout_event(st(revision=REV, phase="Probing"),
                           st(revision=REV, phase="RollingOut", gate="passed", message="3 exact"))
    assert passed == ("Normal", "ProbePassed", f"revision {REV}: 3 exact")
    assert rollout_event(st(revision=REV, phase="RollingOut", gate="passed"),
                         st(revision=REV, phase="Stable", gate="passed")) == (
        "Normal", "RolledOut", f"revision {REV} serves alone")
    same = st(revision=REV, phase="ProbeFailed", gate="failed", message="probe 1")
    assert rollout_event(same, same) is None  # once, not on every pass
    assert rollout_event({}, st(revision=REV, phase="Stable")) is None  # a first revision


def test_the_gate_is_pending_while_the_probe_pods_start_and_fails_past_the_timeout(
        cluster: Cluster) -> None:
    """probing.run_gate against the emulated API: without probe pods it waits and says for
    what; past spec.rollout.probeTimeoutSeconds since the probe Deployments were made it fails
    and names the setting; with both pods ready but no cluster key it cannot ask the router."""
    svc = parse_service({"metadata": {"name": "llm", "namespace": NAMESPACE, "uid": "u"},
                         "spec": {"model": {"uri": "builtin:smollm2-135m"},
                                  "rollout": {"probeTimeoutSeconds": 60}}})
    kube, rev = Kube(cluster.client), spec_revision(svc)
    assert run_gate(kube, svc, rev) == Gate(rev, "pending", "waiting for the prefill and decode "
                                                            f"probe pod(s) of revision {rev}")
    made = []
    for role in ("prefill", "decode"):  # no owner here: the emulator's GC would take them
        probe = build_probe_deployment(svc, role)
        del probe["metadata"]["ownerReferences"]
        made.append(kube.create(probe))
    stamp = datetime.datetime.fromisoformat(made[0]["metadata"]["creationTimestamp"]
                                            .replace("Z", "+00:00"))
    soon = run_gate(kube, svc, rev, now=stamp + datetime.timedelta(seconds=30))
    assert soon.outcome == "pending"
    late = run_gate(kube, svc, rev, now=stamp + datetime.timedelta(seconds=61))
    assert late == Gate(rev, "failed", f"the probe pods of revision {rev} were not ready within "
                                       "60 s (spec.rollout.probeTimeoutSeconds): prefill and "
                                       "decode not ready")
    for role in ("prefill", "decode"):
        template = build_probe_deployment(svc, role)["spec"]["template"]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"llm-{role}-probe-x", "namespace": NAMESPACE,
                            "labels": template["metadata"]["labels"]},
               "spec": template["spec"]}
        kube.create(pod)
        kube.patch("v1", "Pod", NAMESPACE, f"llm-{role}-probe-x", {"status": {
            "podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}},
            subresource="status")
    assert run_gate(kube, svc, rev) == Gate(rev, "pending", "the cluster key Secret "
                                                            "llm-cluster-key is missing or empty")
