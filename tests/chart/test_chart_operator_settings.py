"""The operator's settings in the chart: least-privilege RBAC (cluster-wide or namespaced),
the watched namespace, the pod policy, the image tag and the extra CLI flags it accepts."""

from __future__ import annotations

import dataclasses
import subprocess
from typing import Any

import helm_python as helm
import pytest
from baton_operator.config import OperatorConfig
from baton_operator.main import kopf_args
from baton_operator.policy import PodPolicy
from chart_support import Render, helm_binary, load_docs, only, operator_container, validate_builtin

pytestmark = pytest.mark.timeout(120)  # each test renders with the Helm engine


def granted(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs of a Role or ClusterRole, checking the rules' shape."""
    result: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}  # no nonResourceURLs/resourceNames
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {field}: {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                result.setdefault((group, resource), set()).update(rule["verbs"])
    return result


CHILD_VERBS = {"get", "list", "watch", "create", "patch"}  # no update: only patches
OPTIONAL_CHILD_VERBS = {*CHILD_VERBS, "delete"}  # deleted when the spec drops them
NAMESPACED_RULES = {
    ("baton.dev", "inferenceservices"): {"get", "list", "watch", "patch"},
    ("baton.dev", "inferenceservices/status"): {"patch"},
    ("baton.dev", "inferenceservices/finalizers"): {"update"},
    ("apps", "deployments"): CHILD_VERBS,
    ("", "services"): CHILD_VERBS,
    ("networking.k8s.io", "ingresses"): OPTIONAL_CHILD_VERBS,
    ("networking.k8s.io", "networkpolicies"): OPTIONAL_CHILD_VERBS,  # spec.networkPolicy
    ("autoscaling", "horizontalpodautoscalers"): OPTIONAL_CHILD_VERBS,
    ("policy", "poddisruptionbudgets"): OPTIONAL_CHILD_VERBS,
    # the router's own access (spec.router.discovery: kubernetes)
    ("", "serviceaccounts"): OPTIONAL_CHILD_VERBS,
    ("rbac.authorization.k8s.io", "roles"): OPTIONAL_CHILD_VERBS,
    ("rbac.authorization.k8s.io", "rolebindings"): OPTIONAL_CHILD_VERBS,
    ("", "pods"): {"get", "list", "watch"},  # only to grant them to the router's Role
    ("", "events"): {"create"},
    ("", "secrets"): {"get", "create"},  # each service's cluster key; no list/watch of Secrets
    # serving-signal scalers and scrape targets, where KEDA / the Prometheus operator exist
    ("keda.sh", "scaledobjects"): OPTIONAL_CHILD_VERBS,
    ("monitoring.coreos.com", "podmonitors"): CHILD_VERBS,
}


def test_clusterrole_is_least_privilege(render: Render):
    objs = render()
    role = only(objs, "ClusterRole")
    assert granted(role) == {
        **NAMESPACED_RULES,  # and kopf's watch on CRDs, cluster-wide only
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    }
    binding = only(objs, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    sa = only(objs, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}
    ]
    assert "--all-namespaces" in operator_container(objs)["args"]


@pytest.mark.parametrize(
    ("values", "watched"),
    [({"rbac": {"namespaced": True}}, "baton-system"),
     ({"rbac": {"namespaced": True}, "watchNamespace": "serving"}, "serving")],
    ids=["release-namespace", "watch-namespace"],
)
def test_namespaced_mode_renders_a_role_and_binding_only(render: Render, values, watched):
    objs = render(values)
    assert sorted(o["kind"] for o in objs) == [
        "Deployment", "NetworkPolicy", "Role", "RoleBinding", "ServiceAccount"]
    role, binding = only(objs, "Role"), only(objs, "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == watched
    assert granted(role) == NAMESPACED_RULES
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "baton-operator",
                                    "namespace": "baton-system"}]
    container = operator_container(objs)
    assert container["args"][:3] == ["operator", f"--namespace={watched}", "--standalone"]
    assert {"name": "BATON_OPERATOR_CLUSTER_SCANNING", "value": "false"} in container["env"]
    for obj in objs:
        validate_builtin(obj)


def test_one_watched_namespace_with_cluster_rbac_needs_no_crd_watch(render: Render):
    objs = render({"watchNamespace": "serving"})
    assert granted(only(objs, "ClusterRole")) == NAMESPACED_RULES
    assert "--namespace=serving" in operator_container(objs)["args"]


def test_pod_policy_values_reach_the_operator(render: Render):
    values = {"podPolicy": {"allowHostPath": True, "serviceAccounts": ["a", "b"]}}
    env = {e["name"]: e["value"] for e in operator_container(render(values))["env"]}
    policy = OperatorConfig.from_env(env).policy
    assert policy == PodPolicy(allow_host_path=True, service_accounts=frozenset({"a", "b"}))
    defaults = {e["name"]: e["value"] for e in operator_container(render())["env"]}
    assert OperatorConfig.from_env(defaults) == dataclasses.replace(
        OperatorConfig(), prometheus_url="http://prometheus-operated.monitoring.svc:9090",
        metrics_port=8081)


@pytest.mark.parametrize("tag", [1, 1.5, "1.10"])
def test_a_numeric_image_tag_is_accepted(render: Render, tag):
    container = operator_container(render({"image": {"tag": tag}}))
    assert container["image"] == f"baton:{tag}"


def test_helm_set_image_tag_with_the_real_helm(chart_dir):
    """`helm template --set image.tag=1` (Helm types the value as an integer)."""
    out = subprocess.run([str(helm_binary()), "template", "baton", str(chart_dir), "--set",
                          "image.tag=1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    deployment = next(d for d in load_docs(out.stdout) if d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "baton:1"


GOOD_EXTRA_ARGS = ["--verbose", "-v", "--debug", "-q", "--log-format=json", "--log-refkey=op",
                   "--log-prefix", "--no-log-prefix"]


def test_allowed_extra_args_start_the_operator_cli(render: Render):
    """Every flag the schema lets through is parsed by `baton operator` next to the chart's."""
    from kopf import cli as kopf_cli

    for flag in GOOD_EXTRA_ARGS:
        args = operator_container(render({"operator": {"extraArgs": [flag]}}))["args"]
        assert args[-1] == flag
        kopf_cli.run.make_context("baton operator", kopf_args(args[1:]))


@pytest.mark.parametrize(
    "bad",
    [["--namespace=x"], ["-A"], ["--peering=p"], ["--standalone"], ["--liveness=http://x"],
     ["-m", "evil"], ["--log-format", "json"], ["--log-format=xml"], ["--verbose --debug"],
     ["extra.py"], ["--dev"]],
)
def test_extra_args_the_operator_cannot_start_with_are_rejected(render: Render, bad):
    with pytest.raises(helm.HelmValuesError, match="extraArgs"):
        render({"operator": {"extraArgs": bad}})


def test_the_images_of_inferenceservice_pods_reach_the_operator(render: Render):
    """Unset: the operator's own image, and the same with -cuda for GPU pools."""
    config = OperatorConfig.from_env(
        {e["name"]: e["value"] for e in operator_container(render())["env"]})
    assert (config.images.cpu, config.images.cuda) == ("baton:0.1.0", "baton:0.1.0-cuda")
    values = {"image": {"repository": "reg.example/baton", "tag": "2.0",
                        "cuda": "reg.example/baton-gpu:2.0"}}
    config = OperatorConfig.from_env(
        {e["name"]: e["value"] for e in operator_container(render(values))["env"]})
    assert (config.images.cpu, config.images.cuda) == ("reg.example/baton:2.0",
                                                       "reg.example/baton-gpu:2.0")
