"""kopf running for real (KopfRunner) against the emulated Kubernetes API."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest

from tests.kube.isvc_helpers import (
    CHILD_PLURALS,
    CORE_CHILDREN,
    Cluster,
    OperatorFactory,
    isvc,
    wait_for,
)
from tests.kube.kmock_cluster import EmulatedCluster

pytestmark = pytest.mark.timeout(90)


def core_children(name: str) -> set[tuple[str, str]]:
    return {(kind, pattern.format(n=name)) for kind, pattern in CORE_CHILDREN}


def wait_children(cluster: Cluster, expected: set[tuple[str, str]], timeout: float = 20) -> None:
    wait_for(lambda: expected <= cluster.children(pooled=True).keys(), timeout,
             lambda: f"children {sorted(expected - cluster.children(pooled=True).keys())}")


def wait_reconciled(cluster: Cluster, name: str, generation: int | None = None) -> dict:
    def done() -> dict | None:
        obj = cluster.get(name) or {}
        want = generation or obj.get("metadata", {}).get("generation")
        return obj if (obj.get("status") or {}).get("observedGeneration") == want else None
    return wait_for(done, 20, f"{name} reconciled")


def make_ready(cluster: Cluster, name: str) -> None:
    for role in ("prefill", "decode", "router"):
        cluster.set_deployment_status(cluster.pool_name(name, role))


def test_create_makes_owned_children_and_reconcile_is_idempotent(
        emulated: EmulatedCluster, cluster: Cluster, operator: OperatorFactory) -> None:
    with operator() as runner:
        created = cluster.create(isvc("llm", ingress={"host": "llm.example.com"},
                                      decode={"replicas": 2}))
        expected = core_children("llm") | {("Ingress", "llm"), ("PodDisruptionBudget", "llm-decode")}
        wait_children(cluster, expected)
        obj = wait_reconciled(cluster, "llm")
        children = cluster.children(pooled=True)
        assert children.keys() == expected
        for (kind, name), child in children.items():
            (ref,) = child["metadata"]["ownerReferences"]
            assert ref == {"apiVersion": "baton.dev/v1alpha1", "kind": "InferenceService",
                           "name": "llm", "uid": created["metadata"]["uid"],
                           "controller": True, "blockOwnerDeletion": True}, (kind, name)
            assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "baton-operator"
        prefill = children["Deployment", "llm-prefill"]["spec"]["template"]["spec"]["containers"][0]
        assert prefill["args"][:5] == ["serve", "--model", "builtin:smollm2-135m", "--role", "prefill"]
        assert obj["status"]["url"] == "http://llm.example.com"
        assert obj["status"]["phase"] == "Pending"
        assert obj["metadata"]["finalizers"] == ["baton.dev/finalizer"]
        versions = cluster.versions()
        wait_for(lambda: {f"Created Deployment {cluster.pool_name('llm', 'decode')}",
                          "Created Ingress llm"} <= {
            e["message"] for e in cluster.events() if e["reason"] == "Created"},
            10, "Created events")

        # Re-run the reconcile: an annotation change is an update cause in kopf.
        mark = emulated.request_count()
        cluster.patch("llm", {"metadata": {"annotations": {"touched": "1"}}})
        wait_for(lambda: "touched" in ((cluster.get("llm") or {}).get("metadata", {}).get(
            "annotations", {}).get("baton.dev/last-handled-configuration", "")), 20,
            "the update handler to run")
        time.sleep(0.5)
        assert cluster.versions() == versions, "a reconcile with nothing to do changed children"
        assert emulated.writes(mark, CHILD_PLURALS) == [], "no-op writes to children"
    assert "Handler 'reconcile' succeeded" in runner.output


def test_scaling_decode_patches_only_the_decode_deployment(
        emulated: EmulatedCluster, cluster: Cluster, operator: OperatorFactory) -> None:
    with operator():
        cluster.create(isvc("llm", decode={"replicas": 2}))
        wait_reconciled(cluster, "llm")
        before = cluster.versions()
        mark = emulated.request_count()
        cluster.patch("llm", {"spec": {"decode": {"replicas": 3}}})
        wait_for(lambda: cluster.pool("llm", "decode")["spec"]["replicas"] == 3,
                 20, "decode scaled to 3")
        wait_reconciled(cluster, "llm", generation=2)
        after = cluster.versions()
        assert after.keys() == before.keys()
        changed = {key for key in after if after[key] != before[key]}
        decode = cluster.pool_name("llm", "decode")
        assert changed == {("Deployment", decode)}
        assert emulated.writes(mark, CHILD_PLURALS) == [
            f"PATCH /apis/apps/v1/namespaces/serving/deployments/{decode}"]


def test_spec_changes_roll_the_pods_and_add_or_remove_optional_children(
        cluster: Cluster, operator: OperatorFactory) -> None:
    """A new image is a new revision: both worker pools roll to it in step (rollout.py; the
    gate is off here, the probes need pods: tests/e2e), the autoscaler waits for the end,
    then sizes the new revision's Deployment; the Ingress goes at once."""
    with operator():
        cluster.create(isvc("llm", ingress={"host": "llm.example.com"}, decode={"replicas": 2},
                            rollout={"gate": "none"}))
        wait_reconciled(cluster, "llm")
        old = {role: cluster.pool_name("llm", role) for role in ("prefill", "decode")}
        make_ready(cluster, "llm")
        services = {k: v for k, v in cluster.versions().items() if k[0] == "Service"}
        cluster.patch("llm", {"spec": {"image": "baton:0.2.0", "ingress": None,
                                       "autoscaling": {"decode": {"min": 2, "max": 4, "metric": "cpu"}}}})
        wait_reconciled(cluster, "llm", generation=2)

        def replicas() -> dict[str, int]:
            return {name: d["spec"]["replicas"] for (kind, name), d in cluster.children().items()
                    if kind == "Deployment" and name != "llm-router"}

        def settle(names: list[str]) -> None:
            for name in names:
                cluster.set_deployment_status(name)

        # step 1 of 2: one new pod per pool first, the old ones untouched
        first = wait_for(lambda: r if len(r := replicas()) == 4 else None, 20, "new Deployments")
        new = {role: next(n for n in first if n.startswith(f"llm-{role}-") and n != old[role])
               for role in ("prefill", "decode")}
        assert first == {old["prefill"]: 1, old["decode"]: 2, new["prefill"]: 1, new["decode"]: 1}
        for name in new.values():
            pod = cluster.child("Deployment", name)["spec"]["template"]["spec"]  # type: ignore[index]
            assert pod["containers"][0]["image"] == "baton:0.2.0"
        children = cluster.children()
        assert ("Ingress", "llm") not in children
        assert ("HorizontalPodAutoscaler", "llm-decode") not in children  # paused meanwhile
        rollout = (cluster.get("llm") or {})["status"]["rollout"]
        assert (rollout["phase"], rollout["step"], rollout["decode"]) == ("RollingOut", "1/2",
                                                                          "0/1 new, 2 old")
        # its new pods ready: the old shrink by as much; once they are gone, step 2
        settle(list(new.values()))
        wait_for(lambda: replicas()[old["decode"]] == 1 and replicas()[old["prefill"]] == 0, 20,
                 "the old revision shrunk")
        assert replicas()[new["decode"]] == 1  # not before the old pods have left
        settle(list(old.values()))
        wait_for(lambda: replicas()[new["decode"]] == 2, 20, "step 2")
        settle(list(new.values()))
        wait_for(lambda: replicas()[old["decode"]] == 0, 20, "the old decodes leaving")
        settle([old["decode"]])
        wait_for(lambda: replicas() == {new["prefill"]: 1, new["decode"]: 2}, 20,
                 "the old revision's Deployments deleted")
        hpa = wait_for(lambda: cluster.child("HorizontalPodAutoscaler", "llm-decode"), 20,
                       "the autoscaler back")
        assert hpa["spec"]["maxReplicas"] == 4
        assert hpa["spec"]["scaleTargetRef"]["name"] == new["decode"]
        # The HPA owns replicas now: the operator stops setting them but does not reset them.
        assert cluster.pool("llm", "decode")["spec"]["replicas"] == 2  # type: ignore[index]
        assert (cluster.get("llm") or {})["status"]["rollout"]["phase"] == "Stable"
        wait_for(lambda: [e["message"] for e in cluster.events() if e["reason"] == "RolledOut"],
                 10, "a RolledOut event")
        assert {k: v for k, v in cluster.versions().items() if k[0] == "Service"} == services
        assert (cluster.get("llm") or {})["status"]["url"] == (
            "http://llm.serving.svc.cluster.local:8000")


def test_ready_status_follows_the_child_deployments(cluster: Cluster,
                                                    operator: OperatorFactory) -> None:
    with operator():
        cluster.create(isvc("llm", decode={"replicas": 2}))
        wait_reconciled(cluster, "llm")
        assert cluster.condition("llm", "Ready")["status"] == "False"
        make_ready(cluster, "llm")
        wait_for(lambda: cluster.condition("llm", "Ready").get("status") == "True", 20, "Ready")
        status = (cluster.get("llm") or {})["status"]
        assert status["phase"] == "Ready"
        assert status["prefill"] == {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1,
                                     "desiredReplicas": 1, "tensorParallelSize": 1}
        assert status["decode"] == {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                                    "desiredReplicas": 2, "tensorParallelSize": 1}
        assert status["router"] == {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1,
                                    "desiredReplicas": 1}
        for kind in ("PrefillReady", "DecodeReady", "RouterReady"):
            assert cluster.condition("llm", kind)["status"] == "True"
        assert cluster.condition("llm", "Progressing")["reason"] == "Complete"
        wait_for(lambda: any(e.get("reason") == "Ready" and
                             e["involvedObject"]["name"] == "llm" for e in cluster.events()),
                 10, "a Ready event")

        # a decode pod goes unready
        cluster.set_deployment_status(cluster.pool_name("llm", "decode"), ready=1)
        wait_for(lambda: cluster.condition("llm", "Ready").get("reason") == "PodsNotReady",
                 20, "Ready=False/PodsNotReady")
        status = (cluster.get("llm") or {})["status"]
        assert status["decode"]["readyReplicas"] == 1
        assert cluster.condition("llm", "DecodeReady")["status"] == "False"
        assert cluster.condition("llm", "PrefillReady")["status"] == "True"
        assert "decode 1/2 ready" in cluster.condition("llm", "Ready")["message"]


@pytest.mark.parametrize(("spec", "needle"), [
    ({"kvTransfer": {"backend": "rdma"}}, "rdma"),
    ({"model": {"uri": "hf://not-org-slash-name"}}, "hf://ORG/NAME"),
], ids=["rdma-backend", "malformed-uri"])
def test_invalid_spec_is_reported_and_creates_nothing(
        cluster: Cluster, operator: OperatorFactory, spec: dict, needle: str) -> None:
    with operator() as runner:
        cluster.create(isvc("bad", **spec))
        ready = wait_for(lambda: cluster.condition("bad", "Ready").get("reason") == "InvalidSpec"
                         and cluster.condition("bad", "Ready"), 20, "Ready=False/InvalidSpec")
        assert ready["status"] == "False" and needle in ready["message"]
        assert (cluster.get("bad") or {})["status"]["phase"] == "Failed"
        time.sleep(1.0)  # a PermanentError is not retried: nothing may appear later either
        assert cluster.children() == {}
        wait_for(lambda: any(e.get("reason") == "InvalidSpec" for e in cluster.events()), 10,
                 "an InvalidSpec event")

        fixed = {"kvTransfer": {"backend": "tcp"}, "model": {"uri": "builtin:smollm2-135m"}}
        cluster.patch("bad", {"spec": fixed})
        wait_children(cluster, core_children("bad"))
        wait_for(lambda: cluster.condition("bad", "Ready").get("reason") == "Updating", 20,
                 "InvalidSpec cleared")
    assert "Handler 'reconcile' failed permanently: Invalid spec" in runner.output


def test_delete_leaves_no_finalizer_behind(cluster: Cluster, operator: OperatorFactory) -> None:
    with operator() as runner:
        cluster.create(isvc("llm"))
        obj = wait_reconciled(cluster, "llm")
        assert obj["metadata"]["finalizers"] == ["baton.dev/finalizer"]
        wait_children(cluster, core_children("llm"))
        cluster.delete("llm")
        wait_for(lambda: cluster.get("llm") is None, 20, "the InferenceService to go away")
        # The emulator garbage-collects like kube-controller-manager: owner references work.
        wait_for(lambda: cluster.children() == {}, 10, "children garbage-collected")
    assert "Traceback" not in runner.output


def test_operator_restart_converges(emulated: EmulatedCluster, cluster: Cluster,
                                    operator: OperatorFactory) -> None:
    with operator():
        cluster.create(isvc("llm"))
        wait_reconciled(cluster, "llm")
        wait_children(cluster, core_children("llm"))
    before = cluster.versions()

    # While no operator runs: a spec change, a lost child and a brand-new service.
    cluster.patch("llm", {"spec": {"decode": {"replicas": 2}}})
    cluster.apps.delete_namespaced_deployment("llm-router", cluster.namespace)
    cluster.create(isvc("late"))
    assert cluster.child("Deployment", "llm-router") is None
    mark = emulated.request_count()

    with operator() as runner:
        wait_children(cluster, core_children("llm") | core_children("late"))
        wait_for(lambda: cluster.pool("llm", "decode")["spec"]["replicas"] == 2,
                 20, "decode scaled while the operator was down")
        wait_reconciled(cluster, "llm", generation=2)
        wait_reconciled(cluster, "late")
        after = cluster.versions()
        for key in (("Deployment", cluster.pool_name("llm", "prefill")), ("Service", "llm"),
                    ("Service", "llm-prefill"), ("Service", "llm-decode")):
            assert after[key] == before[key], f"{key} was patched needlessly on resume"
        # Exactly: llm's lost router, its decode PDB (2 replicas now) and late's ten children
        # created, llm's decode patched; nothing else touched.
        writes = Counter(emulated.writes(mark, CHILD_PLURALS))
        assert writes == Counter({
            "POST /apis/apps/v1/namespaces/serving/deployments": 1 + 3,
            "POST /api/v1/namespaces/serving/services": 3,
            "POST /apis/policy/v1/namespaces/serving/poddisruptionbudgets": 1,
            "POST /apis/networking.k8s.io/v1/namespaces/serving/networkpolicies": 4,
            f"PATCH /apis/apps/v1/namespaces/serving/deployments/{cluster.pool_name('llm', 'decode')}": 1})
        make_ready(cluster, "llm")
        wait_for(lambda: cluster.condition("llm", "Ready").get("status") == "True", 20, "Ready")
    assert "Handler 'reconcile' succeeded" in runner.output


def test_transient_api_errors_are_retried_across_a_restart(
        emulated: EmulatedCluster, cluster: Cluster, operator: OperatorFactory) -> None:
    emulated.fail("POST", "deployments", times=1000)
    with operator() as runner:
        cluster.create(isvc("llm"))
        wait_for(lambda: ("Service", "llm") in cluster.children(), 20, "the Services")
        progress = wait_for(lambda: retrying(cluster, "llm"), 20, "kopf retrying the handler")
        assert "HTTP 503" in progress["message"]
        assert not any(kind == "Deployment" for kind, _ in cluster.children())
    # Stopped in the middle of its retries; the API recovers while no operator runs.
    emulated.fail("POST", "deployments", times=0)
    with operator():
        wait_children(cluster, core_children("llm"))
        wait_reconciled(cluster, "llm")
    assert "Handler 'reconcile' failed temporarily: Kubernetes API: HTTP 503" in runner.output


def retrying(cluster: Cluster, name: str) -> dict | None:
    """kopf's progress record of the reconcile handler, once it has been retried twice."""
    annotations = (cluster.get(name) or {}).get("metadata", {}).get("annotations", {})
    progress = json.loads(annotations.get("baton.dev/reconcile", "{}"))
    return progress if progress.get("retries", 0) >= 2 else None
