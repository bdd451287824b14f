"""Child names held by objects the service does not control: never written, never adopted;
the status says which object (Ready=False, reason NameConflict) and clears once it is gone."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.kube.isvc_helpers import (
    NAMESPACE,
    Cluster,
    OperatorFactory,
    deployment_of,
    isvc,
    wait_for,
)
from tests.kube.kmock_cluster import EmulatedCluster
from tests.kube.kubectl_tool import run_kubectl, table_cells

pytestmark = pytest.mark.timeout(90)


def squatter(name: str, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Deployment of a child's name made by someone else: its own selector, host network."""
    labels = {"app": "mine"}
    meta: dict[str, Any] = {"name": name}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return {"metadata": meta, "spec": {
        "replicas": 3, "selector": {"matchLabels": labels},
        "template": {"metadata": {"labels": labels}, "spec": {
            "hostNetwork": True, "containers": [{"name": "app", "image": "mine:1"}]}}}}


def writes_to(emulated: EmulatedCluster, path: str) -> list[str]:
    return [w for w in emulated.writes() if w.endswith(path)]


def test_an_unowned_object_is_a_name_conflict_until_it_is_deleted(
        emulated: EmulatedCluster, cluster: Cluster, operator: OperatorFactory) -> None:
    decode = deployment_of(isvc("llm"), "decode")  # llm-decode-<revision>
    before = cluster.apps.create_namespaced_deployment(NAMESPACE, squatter(decode))
    with operator():
        cluster.create(isvc("llm"))
        ready = wait_for(lambda: cluster.condition("llm", "Ready").get("reason") == "NameConflict"
                         and cluster.condition("llm", "Ready"), 20, "Ready=False/NameConflict")
        assert ready["status"] == "False"
        assert ready["message"].startswith(
            f"Deployment {decode} already exists and has no controller")
        status = (cluster.get("llm") or {})["status"]
        assert status["phase"] == "Failed"
        assert status["decode"]["readyReplicas"] == 0, "the squatter's pods are not ours"
        wait_for(lambda: ("Deployment", "llm-router") in cluster.children(), 10, "the rest")
        row = table_cells(run_kubectl("get", "bisvc", "llm"))[0]
        assert (row["READY"], row["REASON"], row["PHASE"]) == ("False", "NameConflict", "Failed")
        time.sleep(1.0)  # passes keep running (child events): still no write to the squatter
        mine = cluster.child("Deployment", decode) or {}
        assert mine["metadata"]["resourceVersion"] == before.metadata.resource_version
        assert writes_to(emulated, f"/deployments/{decode}") == []
        wait_for(lambda: any(e["reason"] == "NameConflict" for e in cluster.events()), 10,
                 "a NameConflict event")
        warnings = [e for e in cluster.events() if e["reason"] == "NameConflict"]
        assert len(warnings) == 1 and warnings[0]["type"] == "Warning"

        run_kubectl("delete", "deployment", decode)  # its owner clears the name
        wait_for(lambda: (cluster.child("Deployment", decode) or {}).get(
            "metadata", {}).get("ownerReferences"), 10, "our own decode Deployment")
        wait_for(lambda: cluster.condition("llm", "Ready").get("reason") == "Updating", 10,
                 "NameConflict cleared")
        assert (cluster.get("llm") or {})["status"]["phase"] == "Pending"


def test_objects_controlled_by_others_are_left_alone(
        emulated: EmulatedCluster, cluster: Cluster, operator: OperatorFactory) -> None:
    """A hand-made Service and a Deployment another controller owns keep their names."""
    cluster.core.create_namespaced_service(NAMESPACE, {
        "metadata": {"name": "llm"}, "spec": {"ports": [{"port": 80}]}})
    other = cluster.apps.create_namespaced_deployment(NAMESPACE, squatter("other"))
    foreign = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "other",
               "uid": other.metadata.uid, "controller": True}
    cluster.apps.create_namespaced_deployment(NAMESPACE, squatter("llm-router", foreign))
    with operator():
        cluster.create(isvc("llm"))
        ready = wait_for(lambda: cluster.condition("llm", "Ready").get("reason") == "NameConflict"
                         and cluster.condition("llm", "Ready"), 20, "Ready=False/NameConflict")
        wait_for(lambda: "Deployment llm-router" in cluster.condition("llm", "Ready")["message"],
                 10, "both conflicts named")
        ready = cluster.condition("llm", "Ready")
        assert "Service llm already exists and has no controller" in ready["message"]
        assert "is controlled by Deployment other" in ready["message"]
        time.sleep(0.5)
        assert writes_to(emulated, "/services/llm") == []
        assert writes_to(emulated, "/deployments/llm-router") == []
        router = cluster.child("Deployment", "llm-router") or {}
        assert router["metadata"]["ownerReferences"] == [foreign]
        assert router["spec"]["replicas"] == 3
        assert (cluster.child("Service", "llm") or {})["spec"]["ports"] == [
            {"port": 80}], "the hand-made Service is unchanged"
