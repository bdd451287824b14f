"""A spec the API server refuses to take is one stable Ready=False: no flapping while the pools
change, one Event, `kubectl wait --for=condition=Ready` keeps waiting; the operator's own
checks (the CRD's, for an API server that did not run them) catch the usual cases first."""

from __future__ import annotations

import subprocess
import time
from typing import Any

import pytest

from tests.kube.isvc_helpers import NAMESPACE, Cluster, OperatorFactory, isvc, wait_for
from tests.kube.kmock_cluster import EmulatedCluster
from tests.kube.kubectl_tool import kubectl

pytestmark = pytest.mark.timeout(90)


def ready_of(status: dict[str, Any]) -> tuple[str, str, str]:
    cond = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})
    return cond.get("status", ""), cond.get("reason", ""), cond.get("lastTransitionTime", "")


def churn_pools(cluster: Cluster, rounds: int) -> None:
    """Pods coming and going: every round changes each Deployment's status (an event, so a
    pass of the operator) between all-ready and none-ready."""
    for i in range(rounds):
        for role in ("prefill", "decode", "router"):
            cluster.set_deployment_status(cluster.pool_name("llm", role), ready=None if i % 2 else 0)


def test_a_rejected_child_is_one_stable_ready_false(
        emulated: EmulatedCluster, cluster: Cluster, operator: OperatorFactory) -> None:
    emulated.deny("corp-hosts", "ingresses", lambda obj: not obj["spec"]["rules"][0][
        "host"].endswith(".corp.example"), "Ingress hosts must end in .corp.example")
    with operator():
        cluster.create(isvc("llm", ingress={"host": "llm.example.com"}))
        wait_for(lambda: cluster.condition("llm", "Ready").get("reason") == "InvalidSpec", 20,
                 "Ready=False/InvalidSpec")
        message = cluster.condition("llm", "Ready")["message"]
        assert message.startswith("the API server rejected Ingress llm: ")
        assert "ValidatingAdmissionPolicy 'corp-hosts'" in message
        wait_for(lambda: ("Deployment", "llm-router") in cluster.children(), 10, "the pools")
        waiting = subprocess.Popen([str(kubectl()), "-n", NAMESPACE, "wait",
                                    "--for=condition=Ready", "bisvc/llm", "--timeout=4s"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        churn_pools(cluster, rounds=4)  # ends with every pool ready
        wait_for(lambda: all(((cluster.get("llm") or {}).get("status") or {}).get(role, {}).get(
            "readyReplicas") for role in ("prefill", "decode", "router")), 10,
            "the status to count the ready pods")
        assert waiting.wait(20) != 0, "kubectl wait must not see Ready: " + str(
            waiting.communicate()[0])
        statuses = [v.get("status") or {} for v in emulated.history(
            "inferenceservices", NAMESPACE, "llm")]
        readies = {ready_of(s) for s in statuses if s}
        assert len(readies) == 1 and next(iter(readies))[:2] == ("False", "InvalidSpec"), readies
        events = [e for e in cluster.events() if e["involvedObject"]["name"] == "llm"
                  and e["type"] == "Warning" and e["reason"] != "Logging"]
        assert [(e["reason"], e["count"] if e.get("count") else 1) for e in events] == [
            ("InvalidSpec", 1)]

        cluster.patch("llm", {"spec": {"ingress": {"host": "llm.corp.example"}}})
        wait_for(lambda: ("Ingress", "llm") in cluster.children(), 10, "the Ingress, allowed")
        churn_pools(cluster, rounds=2)  # ends all ready
        wait_for(lambda: cluster.condition("llm", "Ready").get("status") == "True", 10, "Ready")


@pytest.mark.parametrize(("spec", "field"), [
    ({"ingress": {"host": "Bad_Host!"}}, "spec.ingress.host 'Bad_Host!'"),
    ({"decode": {"replicas": 2**31}}, "spec.decode.replicas 2147483648"),
    ({"model": {"uri": "file:///etc"}}, "spec.model.uri 'file:///etc': refused by the "
                                        "operator's pod policy (hostPath)"),
], ids=["ingress-host", "int32-replicas", "host-path-model"])
def test_specs_the_api_server_would_refuse_are_caught_before_any_write(
        emulated: EmulatedCluster, cluster: Cluster, operator: OperatorFactory,
        spec: dict[str, Any], field: str) -> None:
    with operator():
        cluster.create(isvc("llm", **spec))
        ready = wait_for(lambda: cluster.condition("llm", "Ready").get("reason") == "InvalidSpec"
                         and cluster.condition("llm", "Ready"), 20, "Ready=False/InvalidSpec")
        assert ready["message"].startswith(field)
        time.sleep(0.5)
        assert cluster.children() == {}
        assert emulated.writes(0, ("deployments", "services", "ingresses")) == []
