"""Spec parsing (defaults and what can never work), level-based status, merge patches."""

from __future__ import annotations

from typing import Any

import pytest
from baton_operator.spec import InvalidSpec, parse_service
from baton_operator.status import (
    Problem,
    compute_status,
    invalid_status,
    ready_event,
    same_status,
)


def body(name: str = "llm", **spec: Any) -> dict[str, Any]:
    spec.setdefault("model", {"uri": "builtin:smollm2-135m"})
    return {"metadata": {"name": name, "namespace": "ml", "uid": "u", "generation": 2},
            "spec": spec}


def test_defaults_match_the_crd() -> None:
    svc = parse_service(body())
    assert (svc.image, svc.image_pull_policy, svc.kv_backend) == (None, "IfNotPresent", "nixl")
    assert {svc.image_for(role) for role in ("prefill", "decode", "router")} == {"baton:0.1.0"}
    assert (svc.prefill.replicas, svc.decode.replicas, svc.router.replicas) == (1, 1, 1)
    assert svc.router.policy == "cache_aware"
    assert svc.prefill.shared_memory_size == "1Gi"
    assert (svc.decode.max_surge, svc.decode.max_unavailable) == ("25%", 0)
    assert svc.ingress is None and dict(svc.autoscaling) == {}
    assert svc.model.served_name == "smollm2-135m"
    assert svc.generation == 2
    assert svc.router.api_key_secret is None
    assert (svc.network_policy.enabled, svc.network_policy.router_from,
            svc.network_policy.metrics_from) == (True, None, ())


@pytest.mark.parametrize(("spec", "field"), [
    ({"kvTransfer": {"backend": "rdma"}}, "spec.kvTransfer.backend"),
    ({"model": {"uri": "hf://only-one-part"}}, "spec.model.uri"),
    ({"model": {"uri": "hf://a/b/c"}}, "spec.model.uri"),
    ({"model": {"uri": "s3://bucket/model"}}, "spec.model.uri"),
    ({"model": {"uri": "pvc://Bad_Claim/x"}}, "spec.model.uri"),
    ({"model": {"uri": "pvc://claim/../etc"}}, "spec.model.uri"),
    ({"model": {"uri": "file://relative/path"}}, "spec.model.uri"),
    ({"model": {"uri": "file:///"}}, "spec.model.uri"),
    ({"model": {"uri": "builtin:"}}, "spec.model.uri"),
    ({"model": {}}, "spec.model.uri"),
    ({"model": {"uri": "builtin:x", "tokenSecretRef": {"name": "s"}}}, "tokenSecretRef"),
    ({"router": {"policy": "random"}}, "spec.router.policy"),
    ({"decode": {"replicas": -1}}, "spec.decode.replicas"),
    ({"decode": {"replicas": "2"}}, "spec.decode.replicas"),
    ({"prefill": {"sharedMemorySize": "lots"}}, "spec.prefill.sharedMemorySize"),
    ({"prefill": {"rolloutStrategy": {"maxSurge": "ten"}}}, "maxSurge"),
    ({"prefill": {"args": ["--ok", 3]}}, "spec.prefill.args"),
    ({"prefill": {"env": [{"value": "x"}]}}, "spec.prefill.env[0].name"),
    ({"prefill": {"template": {"spec": {"containers": [{"image": "x"}]}}}}, "containers[0]"),
    ({"imagePullPolicy": "Sometimes"}, "spec.imagePullPolicy"),
    ({"autoscaling": {"decode": {"min": 5, "max": 2}}}, "spec.autoscaling.decode"),
    ({"autoscaling": {"router": {"min": 1, "max": 2}}}, "spec.autoscaling.router"),
    ({"autoscaling": {"decode": {"min": 1, "max": 2, "target": 150}}}, "target"),
    ({"ingress": {"className": "nginx"}}, "spec.ingress.host"),
    ({"ingress": {"host": "Bad_Host!"}}, "spec.ingress.host"),
    ({"ingress": {"host": "a..b"}}, "spec.ingress.host"),
    ({"decode": {"replicas": 2**31}}, "spec.decode.replicas"),
    ({"router": {"replicas": 2**31}}, "spec.router.replicas"),
    ({"autoscaling": {"decode": {"min": 1, "max": 2**31}}}, "spec.autoscaling.decode.max"),
    ({"model": {"uri": "hf://o/n", "tokenSecretRef": {"name": "a..b"}}}, "tokenSecretRef.name"),
    ({"router": {"auth": {"apiKeySecretRef": {}}}}, "spec.router.auth.apiKeySecretRef.name"),
    # tensor parallelism: each refusal names the field (docs/operator.md "Tensor parallelism")
    ({"prefill": {"gpu": {"count": 2}, "tensorParallelSize": 1}},
     "spec.prefill.tensorParallelSize 1 and the pool's 2 GPU"),
    ({"decode": {"resources": {"limits": {"nvidia.com/gpu": 4}}, "tensorParallelSize": 2}},
     "spec.decode.tensorParallelSize 2 and the pool's 4 GPU"),
    ({"prefill": {"tensorParallelSize": 0}}, "spec.prefill.tensorParallelSize 0"),
    ({"prefill": {"tensorParallelSize": 65}}, "spec.prefill.tensorParallelSize 65"),
    ({"prefill": {"tensorParallelSize": "2"}}, "spec.prefill.tensorParallelSize '2'"),
    ({"model": {"uri": "hf://o/n"}, "prefill": {"tensorParallelSize": 16}},  # default backend
     r"spec.prefill.tensorParallelSize 16 with nixl \(spec.kvTransfer.backend\): a pod's UCX"),
    ({"kvTransfer": {"backend": "tcp"}, "model": {"uri": "hf://o/n"},
      "decode": {"tensorParallelSize": 9, "args": ["--kv-transfer=nixl"]}},
     r"spec.decode.tensorParallelSize 9 with nixl \(spec.decode.args\)"),
    ({"decode": {"args": ["--tp", "2"]}}, "spec.decode.args --tp: set spec.decode.tensorParallel"),
    ({"prefill": {"args": ["--tensor-parallel-size=3"]}}, "spec.prefill.args --tensor-parallel"),
    ({"kvTransfer": {"backend": "tcp"}, "prefill": {"tensorParallelSize": 2}},  # 9 heads, 3 KV
     r"spec.prefill.tensorParallelSize 2 does not divide the model's 9 attention heads or 3 KV "
     r"heads \(nor does 3 divide 2\) \(LlamaForCausalLM\) \(builtin:smollm2-135m\)$"),
    ({"decode": {"gpu": {"count": 1}, "resources": {"limits": {"nvidia.com/gpu": 2}}}},
     "disagree"),
    ({"prefill": {"gpu": {"count": 0}}}, "spec.prefill.gpu.count"),
    ({"prefill": {"gpu": {"memFractionStatic": 1.5}}}, "memFractionStatic"),
    ({"prefill": {"gpu": {"product": "H100 80GB"}}}, "spec.prefill.gpu.product"),
    ({"prefill": {"gpu": {"rdmaResource": "rdma/"}}}, "spec.prefill.gpu.rdmaResource"),
    ({"router": {"auth": {"apiKeySecretRef": {"name": "k", "key": "a/b"}}}},
     "spec.router.auth.apiKeySecretRef.key"),
    ({"networkPolicy": {"enabled": "yes"}}, "spec.networkPolicy.enabled"),
    ({"networkPolicy": {"routerFrom": {"podSelector": {}}}}, "spec.networkPolicy.routerFrom"),
    ({"networkPolicy": {"routerFrom": [{}]}}, "spec.networkPolicy.routerFrom[0]"),
    ({"networkPolicy": {"routerFrom": [{"pods": {}}]}}, "spec.networkPolicy.routerFrom[0]"),
    ({"networkPolicy": {"metricsFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"},
                                          "podSelector": {}}]}}, "metricsFrom[0]: ipBlock"),
    ({"networkPolicy": {"metricsFrom": [{"podSelector": {"matchLabels": {"a": 1}}}]}},
     "metricsFrom[0].podSelector.matchLabels"),
    ({"networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchExpressions": [
        {"key": "a", "operator": "In"}]}}]}}, "matchExpressions[0]: In needs values"),
    ({"networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchExpressions": [
        {"key": "a", "operator": "Near", "values": ["b"]}]}}]}}, "matchExpressions[0].operator"),
])
def test_specs_that_can_never_work_are_rejected_with_the_field(spec: dict[str, Any],
                                                               field: str) -> None:
    with pytest.raises(InvalidSpec, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_service(body(**spec))


def test_names_too_long_for_child_services_are_rejected() -> None:
    parse_service(body(name="a" * 55))
    with pytest.raises(InvalidSpec, match=r"metadata\.name"):
        parse_service(body(name="a" * 56))
    with pytest.raises(InvalidSpec, match=r"metadata\.name"):
        parse_service(body(name="Upper"))


# -- status --------------------------------------------------------------------------------

def deployment(replicas: int, ready: int, *, generation: int = 1, observed: int = 1,
               updated: int | None = None, conditions: list[dict[str, Any]] | None = None
               ) -> dict[str, Any]:
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": observed, "replicas": replicas,
                       "readyReplicas": ready,
                       "updatedReplicas": replicas if updated is None else updated,
                       "conditions": conditions or []}}


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_status_without_children_is_pending() -> None:
    svc = parse_service(body())
    status = compute_status(svc, {}, {}, observed_generation=2, now="t0")
    assert status["phase"] == "Pending"
    assert conditions(status)["Ready"] == ("False", "Updating")
    assert status["prefill"] == {"replicas": 0, "readyReplicas": 0, "updatedReplicas": 0,
                                 "desiredReplicas": 1, "tensorParallelSize": 1}
    assert "tensorParallelSize" not in status["router"]
    assert status["url"] == "http://llm.ml.svc.cluster.local:8000"
    assert status["observedGeneration"] == 2
    assert all(c["observedGeneration"] == 2 and c["lastTransitionTime"] == "t0"
               for c in status["conditions"])
    assert {c["type"] for c in status["conditions"]} == {
        "Ready", "PrefillReady", "DecodeReady", "RouterReady", "Progressing", "Degraded",
        "DisaggregationDegraded"}


def test_status_ready_when_every_pool_is_ready() -> None:
    svc = parse_service(body(decode={"replicas": 2}))
    deps = {"prefill": deployment(1, 1), "decode": deployment(2, 2), "router": deployment(1, 1)}
    status = compute_status(svc, deps, {}, observed_generation=2, now="t0")
    assert status["phase"] == "Ready"
    assert conditions(status) == {
        "Ready": ("True", "AllPoolsReady"), "PrefillReady": ("True", "ReplicasReady"),
        "DecodeReady": ("True", "ReplicasReady"), "RouterReady": ("True", "ReplicasReady"),
        "Progressing": ("False", "Complete"), "Degraded": ("False", "AsExpected"),
        "DisaggregationDegraded": ("False", "Disaggregated")}
    assert status["decode"] == {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                                "desiredReplicas": 2, "tensorParallelSize": 1}


def test_status_pods_not_ready_and_rolling_update() -> None:
    svc = parse_service(body(decode={"replicas": 2}))
    deps = {"prefill": deployment(1, 1), "decode": deployment(2, 1), "router": deployment(1, 1)}
    status = compute_status(svc, deps, {}, observed_generation=2)
    assert status["phase"] == "Progressing"
    assert conditions(status)["Ready"] == ("False", "PodsNotReady")
    assert conditions(status)["DecodeReady"] == ("False", "PodsNotReady")
    assert conditions(status)["PrefillReady"] == ("True", "ReplicasReady")
    assert conditions(status)["Progressing"] == ("True", "RollingOut")
    deps["prefill"] = deployment(1, 1, generation=2, observed=1)  # controller not caught up
    status = compute_status(svc, deps, {}, observed_generation=2)
    assert conditions(status)["Ready"] == ("False", "Updating")
    assert conditions(status)["PrefillReady"] == ("False", "Updating")


def test_status_degraded_when_a_rollout_is_stuck() -> None:
    svc = parse_service(body())
    stuck = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
              "message": "ReplicaSet has timed out progressing."}]
    deps = {"prefill": deployment(1, 0, updated=1, conditions=stuck),
            "decode": deployment(1, 1), "router": deployment(1, 1)}
    status = compute_status(svc, deps, {}, observed_generation=2)
    assert status["phase"] == "Degraded"
    assert conditions(status)["Degraded"] == ("True", "RolloutFailed")
    assert "prefill: ProgressDeadlineExceeded" in next(
        c["message"] for c in status["conditions"] if c["type"] == "Degraded")


def test_status_is_level_based_and_keeps_transition_times() -> None:
    svc = parse_service(body())
    deps = {"prefill": deployment(1, 1), "decode": deployment(1, 0), "router": deployment(1, 1)}
    first = compute_status(svc, deps, {}, observed_generation=2, now="t0")
    again = compute_status(svc, deps, first, observed_generation=2, now="t1")
    assert again == first and same_status(again, first)
    deps["decode"] = deployment(1, 1)
    ready = compute_status(svc, deps, again, observed_generation=2, now="t2")
    times = {c["type"]: c["lastTransitionTime"] for c in ready["conditions"]}
    assert times["Ready"] == "t2" and times["DecodeReady"] == "t2"
    assert times["PrefillReady"] == "t0" and times["Degraded"] == "t0"
    assert not same_status(ready, again)


def test_invalid_status_keeps_the_rest() -> None:
    previous = {"phase": "Ready", "url": "http://x", "kopf": {"progress": {}},
                "conditions": [{"type": "DecodeReady", "status": "True"}]}
    status = invalid_status("spec.kvTransfer.backend 'rdma': bad", 3, previous, now="t")
    assert status["phase"] == "Failed" and status["observedGeneration"] == 3
    assert status["url"] == "http://x" and "kopf" not in status
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
    assert "rdma" in ready["message"]
    assert {"type": "DecodeReady", "status": "True"} in status["conditions"]


def test_hostnames_and_the_largest_replica_count_are_accepted() -> None:
    svc = parse_service(body(ingress={"host": "*.llm.example.com"},
                             decode={"replicas": 2**31 - 1}))
    assert svc.ingress is not None and svc.ingress.host == "*.llm.example.com"
    assert svc.decode.replicas == 2**31 - 1


def test_problems_make_one_stable_ready_false_whatever_the_pools_say() -> None:
    svc = parse_service(body())
    deps = {"prefill": deployment(1, 1), "decode": deployment(1, 1), "router": deployment(1, 1)}
    problems = [Problem("NameConflict", "Deployment llm-decode already exists"),
                Problem("InvalidSpec", "the API server rejected Ingress llm: bad")]
    status = compute_status(svc, deps, {}, 2, problems, now="t0")
    assert status["phase"] == "Failed"
    assert conditions(status)["Ready"] == ("False", "NameConflict")
    assert conditions(status)["Progressing"] == ("False", "NameConflict")
    assert conditions(status)["DecodeReady"] == ("True", "ReplicasReady")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["message"] == ("Deployment llm-decode already exists; "
                                "the API server rejected Ingress llm: bad")
    deps["decode"] = deployment(1, 0)  # pools change: Ready stays as it was, same time
    again = compute_status(svc, deps, status, 2, problems, now="t1")
    assert next(c for c in again["conditions"] if c["type"] == "Ready") == ready


def test_a_problem_of_one_pool_is_its_condition_too() -> None:
    svc = parse_service(body())
    deps = {"prefill": deployment(0, 0), "decode": deployment(1, 1), "router": deployment(1, 1)}
    refused = Problem("ModelNotServable", "prefill: unsupported architecture 'X'", role="prefill")
    status = compute_status(svc, deps, {}, 2, [refused], now="t0")
    assert status["phase"] == "Failed"
    assert {kind: conditions(status)[kind] for kind in ("Ready", "PrefillReady", "DecodeReady")} == {
        "Ready": ("False", "ModelNotServable"), "PrefillReady": ("False", "ModelNotServable"),
        "DecodeReady": ("True", "ReplicasReady")}
    prefill = next(c for c in status["conditions"] if c["type"] == "PrefillReady")
    assert prefill["message"] == refused.message
    assert ready_event({}, status) == ("Warning", "ModelNotServable", refused.message)


def ready(status: str, reason: str) -> dict[str, Any]:
    return {"conditions": [{"type": "Ready", "status": status, "reason": reason,
                            "message": "m"}]}


@pytest.mark.parametrize(("old", "new", "event"), [
    ({}, ready("False", "Updating"), ("Normal", "Updating", "m")),
    (ready("False", "Updating"), ready("False", "PodsNotReady"), None),
    (ready("False", "PodsNotReady"), ready("True", "AllPoolsReady"), ("Normal", "Ready", "m")),
    (ready("True", "AllPoolsReady"), ready("False", "Updating"), ("Normal", "Updating", "m")),
    (ready("True", "AllPoolsReady"), ready("False", "PodsNotReady"),
     ("Warning", "PodsNotReady", "m")),
    ({}, ready("False", "InvalidSpec"), ("Warning", "InvalidSpec", "m")),
    (ready("False", "Updating"), ready("False", "NameConflict"), ("Warning", "NameConflict", "m")),
    (ready("False", "NameConflict"), ready("False", "NameConflict"), None),
    (ready("False", "NameConflict"), ready("False", "Updating"), ("Normal", "Updating", "m")),
])
def test_events_warn_about_problems_and_report_progress_as_normal(
        old: dict[str, Any], new: dict[str, Any], event: tuple[str, str, str] | None) -> None:
    assert ready_event(old, new) == event


@pytest.mark.parametrize("fallback", ["fail", "colocated"])
def test_no_ready_prefill_is_a_disaggregation_degraded_condition(fallback: str) -> None:
    svc = parse_service(body(router={"fallback": fallback}))
    gone = {"prefill": deployment(1, 0), "decode": deployment(1, 1), "router": deployment(1, 1)}
    reason = {"fail": "NoPrefill", "colocated": "DecodesPrefillLocally"}[fallback]
    status = compute_status(svc, gone, {}, observed_generation=2, now="t0")
    assert conditions(status)["DisaggregationDegraded"] == ("True", reason)
    assert conditions(status)["Ready"][0] == "False"
    back = {**gone, "prefill": deployment(1, 1)}
    status = compute_status(svc, back, status, observed_generation=2, now="t1")
    assert conditions(status)["DisaggregationDegraded"] == ("False", "Disaggregated")
    nothing = {**gone, "decode": deployment(1, 0)}  # no decode either: nothing to degrade to
    status = compute_status(svc, nothing, {}, observed_generation=2, now="t0")
    assert conditions(status)["DisaggregationDegraded"][0] == "False"


def test_a_bad_fallback_is_invalid() -> None:
    with pytest.raises(InvalidSpec, match=r"spec\.router\.fallback"):
        parse_service(body(router={"fallback": "maybe"}))
