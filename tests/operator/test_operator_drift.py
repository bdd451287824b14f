"""Hand edits and deletions of children, made with the real kubectl, are undone within seconds
by the operator (kopf for real, its resync timer at 60 s: the child watches do it); fields the
operator hands over (an HPA's replicas) are left alone."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.kube.isvc_helpers import (
    CHILD_PLURALS,
    NAMESPACE,
    Cluster,
    OperatorFactory,
    deployment_of,
    isvc,
    wait_for,
)
from tests.kube.kmock_cluster import EmulatedCluster
from tests.kube.kubectl_tool import run_kubectl

pytestmark = pytest.mark.timeout(120)
RESTORE_WITHIN = 10.0
SPEC = {"decode": {"replicas": 2}, "ingress": {"host": "llm.example.com"},
        "autoscaling": {"prefill": {"min": 1, "max": 3, "metric": "cpu"}}}
PREFILL, DECODE = (deployment_of(isvc("llm", **SPEC), role) for role in ("prefill", "decode"))


def spec_of(cluster: Cluster, kind: str, name: str) -> dict[str, Any]:
    return (cluster.child(kind, name) or {}).get("spec") or {}


def main_container(deployment: dict[str, Any]) -> dict[str, Any]:
    return dict(deployment["spec"]["template"]["spec"]["containers"][0])


# what, kubectl args that tamper, (plural, name) of the child, a check on it that holds
# while it is as the operator renders it
Check = Callable[[dict[str, Any]], bool]
TAMPERING: list[tuple[str, list[str], tuple[str, str], Check]] = [
    ("decode scaled by hand", ["scale", f"deploy/{DECODE}", "--replicas=5"],
     ("deployments", DECODE), lambda d: d["spec"]["replicas"] == 2),
    ("router image replaced", ["set", "image", "deploy/llm-router", "main=evil:1"],
     ("deployments", "llm-router"), lambda d: main_container(d)["image"] == "baton:0.1.0"),
    ("decode made privileged", ["patch", f"deploy/{DECODE}", "-p",
                                '{"spec":{"template":{"spec":{"containers":[{"name":"main",'
                                '"securityContext":{"privileged":true}}]}}}}'],
     ("deployments", DECODE),
     lambda d: "privileged" not in main_container(d)["securityContext"]),
    ("router Service selector hijacked", ["patch", "svc/llm", "-p",
                                          '{"spec":{"selector":{"app":"hijack"}}}'],
     ("services", "llm"), lambda s: "app" not in s["spec"]["selector"]),
    ("decode Service selector replaced", ["patch", "svc/llm-decode", "--type=json", "-p",
                                          '[{"op":"replace","path":"/spec/selector",'
                                          '"value":{"app":"hijack"}}]'],
     ("services", "llm-decode"), lambda s: s["spec"]["selector"] == {
         "app.kubernetes.io/name": "baton", "app.kubernetes.io/instance": "llm",
         "baton.dev/role": "decode"}),
    ("Ingress pointed elsewhere", ["patch", "ingress/llm", "--type=json", "-p",
                                   '[{"op":"replace","path":"/spec/rules/0/http/paths/0/backend/'
                                   'service/name","value":"evil"}]'],
     ("ingresses", "llm"),
     lambda i: i["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"] == "llm"),
    ("HPA ceiling raised", ["patch", "hpa/llm-prefill", "-p", '{"spec":{"maxReplicas":50}}'],
     ("horizontalpodautoscalers", "llm-prefill"), lambda h: h["spec"]["maxReplicas"] == 3),
    ("PDB loosened", ["patch", "pdb/llm-decode", "-p", '{"spec":{"maxUnavailable":2}}'],
     ("poddisruptionbudgets", "llm-decode"), lambda p: p["spec"]["maxUnavailable"] == 1),
]
DELETIONS = [("Deployment", "deploy", DECODE), ("Service", "svc", "llm"),
             ("Ingress", "ingress", "llm"), ("HorizontalPodAutoscaler", "hpa", "llm-prefill"),
             ("PodDisruptionBudget", "pdb", "llm-decode")]


def restored(emulated: EmulatedCluster, plural: str, name: str, check: Check,
             since: int) -> float:
    """Seconds until the child is as rendered again, after the history shows the tampering
    (a version after the `since`-th that fails `check`)."""
    started = time.monotonic()

    def undone() -> bool:
        versions = emulated.history(plural, NAMESPACE, name)
        tampered = any(not check(v) for v in versions[since:])
        return tampered and bool(versions) and check(versions[-1])

    wait_for(undone, RESTORE_WITHIN, f"{plural}/{name} restored")
    return time.monotonic() - started


def start(cluster: Cluster) -> None:
    cluster.create(isvc("llm", **SPEC))
    wait_for(lambda: {("Ingress", "llm"), ("HorizontalPodAutoscaler", "llm-prefill"),
                      ("PodDisruptionBudget", "llm-decode")} <= cluster.children().keys(),
             20, "every kind of child")


def test_tampering_with_each_kind_of_child_is_undone(
        emulated: EmulatedCluster, cluster: Cluster, operator: OperatorFactory) -> None:
    with operator():
        start(cluster)
        for what, args, (plural, name), check in TAMPERING:
            since = len(emulated.history(plural, NAMESPACE, name))
            assert check(emulated.history(plural, NAMESPACE, name)[-1]), what
            run_kubectl(*args)
            took = restored(emulated, plural, name, check, since)
            assert took < RESTORE_WITHIN, what
        wait_for(lambda: any(f"Patched Deployment {DECODE} (spec.replicas)" in e["message"]
                             for e in cluster.events()), 10, "an Event naming the field")
        # Settled: our own writes trigger passes that find nothing to do.
        mark = emulated.request_count()
        time.sleep(1.5)
        assert emulated.writes(mark, CHILD_PLURALS) == []


def test_deleted_children_come_back(cluster: Cluster, operator: OperatorFactory) -> None:
    with operator():
        start(cluster)
        for kind, short, name in DELETIONS:
            uid = (cluster.child(kind, name) or {})["metadata"]["uid"]
            run_kubectl("delete", short, name, "--wait=false")
            wait_for(lambda kind=kind, name=name, uid=uid: (  # type: ignore[misc]
                cluster.child(kind, name) or {"metadata": {"uid": uid}})["metadata"]["uid"] != uid,
                RESTORE_WITHIN, f"{kind} {name} recreated")


def test_replicas_owned_by_the_hpa_are_left_alone(emulated: EmulatedCluster, cluster: Cluster,
                                                  operator: OperatorFactory) -> None:
    with operator():
        start(cluster)
        run_kubectl("scale", f"deploy/{PREFILL}", "--replicas=3")  # what the HPA does
        run_kubectl("scale", "deploy/llm-router", "--replicas=4")  # not autoscaled: ours
        wait_for(lambda: spec_of(cluster, "Deployment", "llm-router")["replicas"] == 1,
                 RESTORE_WITHIN, "router replicas restored")
        assert spec_of(cluster, "Deployment", PREFILL)["replicas"] == 3
        wait_for(lambda: (cluster.get("llm") or {}).get("status", {}).get("prefill", {}).get(
            "desiredReplicas") == 3, 10, "status shows the HPA's choice")
        writes = emulated.writes(0, ("deployments",))
        assert not any(w.endswith(f"/{PREFILL}") and w.startswith("PATCH") for w in writes)
