"""The chart's RBAC, namespaced and cluster-wide, against an API server that enforces it: the
operator runs as its ServiceAccount with the args and env of the chart's Deployment, takes a
service through its whole life, is never refused, and uses every permission it is granted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from charts.manifests import render_chart
from tests.kube import stand_in_apis
from tests.kube.isvc_helpers import NAMESPACE, Cluster, isvc, wait_for
from tests.kube.kmock_cluster import EmulatedCluster
from tests.kube.kubectl_tool import run_kubectl
from tests.kube.operator_process import running_operator

pytestmark = pytest.mark.timeout(150)
RELEASE_NAMESPACE = "baton-system"
USER = f"system:serviceaccount:{RELEASE_NAMESPACE}:baton-operator"
# Only for the OwnerReferencesPermissionEnforcement admission plugin (blockOwnerDeletion),
# which the emulated API does not run: granted, never requested.
NEVER_REQUESTED = {("update", "baton.dev", "inferenceservices/finalizers")}
# Held only to grant it to a router's Role (the operator lists and watches pods, it never gets
# one): RBAC refuses a Role that grants more than its creator holds (the escalation check,
# which the emulated API does not run).
GRANTED_TO_ROUTERS = {("get", "", "pods")}
SPEC = {"decode": {"replicas": 2}, "ingress": {"host": "llm.example.com"},
        "autoscaling": {"prefill": {"min": 1, "max": 3, "metric": "cpu"},
                        "decode": {"min": 1, "max": 4}}}  # kv: a ScaledObject (KEDA)
TAMPER = [("deployment/llm-router", '{"spec":{"replicas":5}}'),
          ("service/llm", '{"spec":{"selector":{"app":"x"}}}'),
          ("ingress/llm", '{"spec":{"rules":[{"host":"evil.example.com"}]}}'),
          ("horizontalpodautoscalers.v2.autoscaling/llm-prefill",  # not the preferred v1
           '{"spec":{"maxReplicas":9}}'),
          ("pdb/llm-decode", '{"spec":{"maxUnavailable":2}}'),
          ("networkpolicy/llm-decode", '{"spec":{"ingress":[{}]}}'),
          ("role/llm-router", '{"rules":[{"apiGroups":[""],"resources":["secrets"],'
                              '"verbs":["get"]}]}'),
          ("rolebinding/llm-router", '{"subjects":[{"kind":"User","name":"mallory"}]}'),
          ("serviceaccount/llm-router", '{"automountServiceAccountToken":true}'),
          ("scaledobject/llm-decode", '{"spec":{"maxReplicaCount":9}}'),
          ("podmonitor/llm", '{"spec":{"podTargetLabels":[]}}')]


def install(emulated: EmulatedCluster, values: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """`helm template` with `values`, the chart's RBAC and ServiceAccount applied; returns the
    operator's container as rendered."""
    docs = [yaml.safe_load(text) for text in render_chart(values).values()]
    cluster_admin = Cluster(RELEASE_NAMESPACE)
    cluster_admin.create_namespace()
    for api in ("keda", "prometheus-operator"):  # the operator writes their kinds too
        stand_in_apis.install(cluster_admin.client, api)
    rbac = tmp / "rbac.yaml"
    rbac.write_text(yaml.safe_dump_all([d for d in docs if d["kind"] != "Deployment"]))
    run_kubectl("--validate=false", "apply", "-f", str(rbac), namespace=None)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    return dict(deployment["spec"]["template"]["spec"]["containers"][0])


def granted() -> set[tuple[str, str, str]]:
    """(verb, apiGroup, resource) of every rule stored in the cluster."""
    found = set()
    for role in [*run_yaml("clusterroles"), *run_yaml("roles", NAMESPACE)]:
        for rule in role.get("rules") or []:
            found |= {(v, g, r) for v in rule["verbs"] for g in rule["apiGroups"]
                      for r in rule["resources"]}
    return found


def run_yaml(plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
    text = run_kubectl("get", plural, "-o", "yaml", namespace=namespace)
    return list(yaml.safe_load(text)["items"])


def life_of_a_service(cluster: Cluster) -> None:
    """Create, tamper with each kind of child, become Ready, drop the optional children,
    delete: every request the operator makes in normal work."""
    cluster.create(isvc("llm", **SPEC))
    wait_for(lambda: len(cluster.children()) == 14, 30, "fourteen children")
    for target, patch in TAMPER:
        field = "{.spec}" if "spec" in patch else "{.rules}{.subjects}{.automountServiceAccountToken}"
        before = run_kubectl("get", target, "-o", f"jsonpath={field}")
        run_kubectl("patch", target, "--type=merge", "-p", patch)
        wait_for(lambda t=target, b=before, f=field: run_kubectl(  # type: ignore[misc]
            "get", t, "-o", f"jsonpath={f}") == b, 10, f"{target} restored")
    for role in ("prefill", "decode", "router"):
        cluster.set_deployment_status(cluster.pool_name("llm", role))
    wait_for(lambda: cluster.condition("llm", "Ready").get("status") == "True", 10, "Ready")
    cluster.patch("llm", {"spec": {"ingress": None, "autoscaling": None,
                                   "decode": {"replicas": 1}, "router": {"discovery": "dns"},
                                   "networkPolicy": {"enabled": False}}})
    wait_for(lambda: len(cluster.children()) == 6, 10, "optional children deleted")
    wait_for(lambda: stand_in_apis.get(cluster.custom, "keda", NAMESPACE, "llm-decode") is None,
             10, "the ScaledObject deleted")
    wait_for(lambda: not any(n.endswith("/llm-router") for n in run_kubectl(
        "get", "serviceaccounts,roles,rolebindings", "-o", "name").split()), 10,
        "the router's ServiceAccount, Role and RoleBinding deleted")
    cluster.delete("llm")
    wait_for(lambda: cluster.get("llm") is None, 10, "the finalizer removed")


@pytest.mark.parametrize("values", [{"rbac": {"namespaced": True}, "watchNamespace": NAMESPACE},
                                    {}], ids=["namespaced", "cluster"])
def test_the_chart_rbac_is_enough_and_every_permission_is_used(
        emulated: EmulatedCluster, cluster: Cluster, tmp_path: Path,
        values: dict[str, Any]) -> None:
    container = install(emulated, values, tmp_path)
    kubeconfig = tmp_path / "operator.kubeconfig"
    kubeconfig.write_text(emulated.service_account_kubeconfig(RELEASE_NAMESPACE, "baton-operator"))
    env = {e["name"]: e["value"] for e in container["env"] if e["name"] != "HOME"}
    flags = [a for a in container["args"][1:] if not a.startswith("--liveness")]
    with running_operator(flags, tmp_path / "operator.log",
                          {**env, "KUBECONFIG": str(kubeconfig)}):
        life_of_a_service(cluster)
    decisions = emulated.rbac_decisions(USER)
    denied = [a for a, ok in decisions if not ok]
    assert denied == [], (tmp_path / "operator.log").read_text()[-3000:]
    used = {(a.verb, a.group, a.resource) for a, _ in decisions}
    assert used == granted() - NEVER_REQUESTED - GRANTED_TO_ROUTERS


def test_a_missing_permission_is_refused(emulated: EmulatedCluster, cluster: Cluster,
                                         tmp_path: Path) -> None:
    """The same set-up without `patch` on Deployments: the API server refuses exactly that."""
    install(emulated, {"rbac": {"namespaced": True}, "watchNamespace": NAMESPACE}, tmp_path)
    role = run_yaml("roles", NAMESPACE)[0]
    for rule in role["rules"]:
        if rule["resources"] == ["deployments"]:
            rule["verbs"].remove("patch")
    cluster_role = tmp_path / "role.yaml"
    cluster_role.write_text(yaml.safe_dump(role))
    run_kubectl("--validate=false", "apply", "-f", str(cluster_role))
    kubeconfig = tmp_path / "operator.kubeconfig"
    kubeconfig.write_text(emulated.service_account_kubeconfig(RELEASE_NAMESPACE, "baton-operator"))
    with running_operator(["--standalone", f"--namespace={NAMESPACE}"], tmp_path / "log",
                          {"KUBECONFIG": str(kubeconfig),
                           "BATON_OPERATOR_CLUSTER_SCANNING": "false"}):
        cluster.create(isvc("llm"))
        wait_for(lambda: ("Deployment", "llm-router") in cluster.children(), 20, "children")
        decode = cluster.pool_name("llm", "decode")
        run_kubectl("scale", f"deployment/{decode}", "--replicas=3")
        wait_for(lambda: any(not ok for _, ok in emulated.rbac_decisions(USER)), 10, "a 403")
    denied = {(a.verb, a.resource, a.name) for a, ok in emulated.rbac_decisions(USER) if not ok}
    assert denied == {("patch", "deployments", decode)}
