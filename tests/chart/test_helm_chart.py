"""The Helm chart, rendered and linted by the real Helm v4 engine, validated offline."""

from __future__ import annotations

import json
import textwrap
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from chart_support import K8S_VERSIONS, Render, only, operator_container, validate_builtin

pytestmark = pytest.mark.timeout(120)  # each test renders with the Helm engine

# Non-default values that exercise every optional branch of the templates.
FULL_VALUES: dict[str, Any] = {
    "fullnameOverride": "llm",
    "image": {"repository": "registry.example.com/baton", "tag": "1.2.3", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "operator": {
        "extraArgs": ["--verbose"],
        "extraEnv": [{"name": "KOPF_X", "value": "1"}],
    },
    "serviceAccount": {"annotations": {"iam.example.com/role": "baton"}},
    "podAnnotations": {"example.com/scrape": "false"},
    "podLabels": {"team": "ml", "app.kubernetes.io/component": "hijack"},
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [
        {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}
    ],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["cpu"]}]}
                ]
            }
        }
    },
    "priorityClassName": "system-cluster-critical",
    "sample": {"enabled": True, "name": "demo"},
}
CASES = {"defaults": {}, "sample": {"sample": {"enabled": True}}, "full": FULL_VALUES}


@pytest.mark.parametrize(
    "values", [{}, {"sample": {"enabled": True}}, FULL_VALUES], ids=list(CASES)
)
def test_chart_lints_clean(chart_dir, values):
    report = helm.lint(chart_dir, values, strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    # severity 1 is "info" (e.g. "icon is recommended"); warnings (2) and errors (3) fail
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_default_render_has_operator_objects_only(render: Render):
    objs = render()
    assert sorted(o["kind"] for o in objs) == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "NetworkPolicy",
        "ServiceAccount",
    ]
    for obj in objs:
        if obj["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert obj["metadata"]["namespace"] == "baton-system"


def test_sample_renders_a_valid_inferenceservice(render: Render, crd_schema, sample):
    isvc = only(
        render({"sample": {"enabled": True}}, name="demo", namespace="ml"), "InferenceService"
    )
    assert isvc["apiVersion"] == "baton.dev/v1alpha1"
    assert isvc["metadata"]["namespace"] == "ml"
    assert isvc["metadata"]["name"] == "smollm2"
    jsonschema.validate(isvc, crd_schema)
    # the chart's sample and manifests/samples/ describe the same service
    assert isvc["spec"] == sample["spec"]


@pytest.mark.parametrize("case", list(CASES))
def test_every_rendered_object_validates_against_kubernetes_schemas(
    render: Render, crd_schema, case
):
    for obj in render(CASES[case]):
        if obj["kind"] == "InferenceService":
            jsonschema.validate(obj, crd_schema)
            continue
        validate_builtin(obj)


def test_crd_validates_as_apiextensions_v1(crd):
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(crd, version, strict=True)


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"replicaCount": "two"}, "/replicaCount"),
        ({"replicaCount": 2}, "/replicaCount"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"replicaCount": 1, "replicas": 1}, "replicas"),
        ({"resources": {"limits": {"memory": "lots"}}}, "/resources/limits/memory"),
        ({"livenessProbe": {"periodSeconds": 0}}, "/livenessProbe/periodSeconds"),
        ({"sample": {"enabled": "yes"}}, "/sample/enabled"),
        ({"sample": {"name": "Not_A_DNS_Name"}}, "/sample/name"),
        ({"sample": {"spec": {"model": {"uri": "s3://bucket/model"}}}}, "/sample/spec/model/uri"),
    ],
)
def test_values_schema_rejects_bad_values(render: Render, values, field):
    with pytest.raises(helm.HelmValuesError) as err:
        render(values)
    assert field in str(err.value)


def test_operator_deployment_is_hardened(render: Render):
    deployment = only(render(), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = operator_container(render())["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "privileged" not in sc
    # read-only root: /tmp is a writable emptyDir and HOME points there
    mounts = {m["name"]: m["mountPath"] for m in operator_container(render())["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts == {"tmp": "/tmp"}
    assert "emptyDir" in volumes["tmp"]
    assert {"name": "HOME", "value": "/tmp"} in operator_container(render())["env"]
    assert "hostNetwork" not in pod and "hostPID" not in pod


def test_operator_runs_the_contract_command_with_liveness(render: Render):
    deployment = only(render(), "Deployment")
    container = operator_container(render())
    assert container["image"] == "baton:0.1.0"
    assert container["args"] == [
        "operator",
        "--all-namespaces",
        "--standalone",
        "--liveness=http://0.0.0.0:8080/healthz",
    ]
    assert container["ports"] == [{"name": "health", "containerPort": 8080},
                                  {"name": "metrics", "containerPort": 8081}]
    probe = container["livenessProbe"]
    assert probe["httpGet"] == {"path": "/healthz", "port": "health"}
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}


def test_values_reach_the_deployment(render: Render):
    objs = render(FULL_VALUES)
    deployment = only(objs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = operator_container(objs)
    assert deployment["metadata"]["name"] == "llm-operator"
    assert container["image"] == "registry.example.com/baton:1.2.3"
    assert container["imagePullPolicy"] == "Always"
    assert container["args"][-1] == "--verbose"
    assert {"name": "KOPF_X", "value": "1"} in container["env"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["nodeSelector"] == FULL_VALUES["nodeSelector"]
    assert pod["tolerations"] == FULL_VALUES["tolerations"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["serviceAccountName"] == only(objs, "ServiceAccount")["metadata"]["name"]
    # podLabels are added, but can never break the Deployment's selector
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["team"] == "ml"
    for key, value in deployment["spec"]["selector"]["matchLabels"].items():
        assert labels[key] == value


def test_existing_service_account(render: Render):
    objs = render({"serviceAccount": {"create": False, "name": "existing"}})
    assert [o for o in objs if o["kind"] == "ServiceAccount"] == []
    assert only(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "existing"
    assert only(objs, "ClusterRoleBinding")["subjects"][0]["name"] == "existing"
    with pytest.raises(helm.HelmRenderError, match=r"serviceAccount\.name is required"):
        render({"serviceAccount": {"create": False}})


def test_rbac_can_be_left_to_the_cluster_admin(render: Render):
    kinds = {o["kind"] for o in render({"rbac": {"create": False}})}
    assert kinds == {"ServiceAccount", "Deployment", "NetworkPolicy"}


def test_the_operator_pod_takes_no_inbound_connection(render: Render):
    """Its NetworkPolicy selects exactly the operator's pods and lets nothing in (kopf's
    /healthz is probed by the kubelet, which policies never block); values can turn it off."""
    objs = render()
    policy = next(o for o in objs if o["kind"] == "NetworkPolicy")
    pod = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert selector == next(o for o in objs if o["kind"] == "Deployment")["spec"]["selector"][
        "matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"] and policy["spec"]["ingress"] == []
    assert policy["metadata"]["namespace"] == "baton-system"
    assert "NetworkPolicy" not in {o["kind"] for o in render({"networkPolicy": {"enabled": False}})}


@pytest.mark.parametrize("case", list(CASES))
def test_standard_labels_on_every_object(render: Render, case):
    for obj in render(CASES[case], name="rel"):
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "baton"
        assert labels["app.kubernetes.io/instance"] == "rel"
        assert labels["app.kubernetes.io/version"] == "0.1.0"
        assert labels["app.kubernetes.io/part-of"] == "baton"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == "baton-0.1.0"


def test_notes_print_a_sample_and_point_at_nothing_outside_the_chart(chart_dir, crd_schema):
    with helm.Chart.load(chart_dir) as chart:
        off = chart.render({}, name="baton", namespace="ops")["baton/templates/NOTES.txt"]
        on = chart.render({"sample": {"enabled": True}}, name="baton", namespace="ops")[
            "baton/templates/NOTES.txt"
        ]
        scoped = chart.render({"rbac": {"namespaced": True}, "watchNamespace": "ml"},
                              name="baton", namespace="ops")["baton/templates/NOTES.txt"]
    assert "deployment/baton-operator" in off and "watches every namespace" in off
    assert "manifests/" not in off and ".yaml" not in off, "a chart user has no repository"
    sample = yaml.safe_load(textwrap.dedent(off.split("<<'YAML'\n")[1].split("  YAML\n")[0]))
    assert sample["kind"] == "InferenceService" and sample["metadata"]["name"] == "smollm2"
    jsonschema.validate(sample, crd_schema)
    assert "get bisvc smollm2" in on
    assert "watches namespace ml" in scoped and "kubectl -n ml apply -f -" in scoped


# Sections passed through to Kubernetes as a whole: documented by the comment above them.
PASSTHROUGH_SECTIONS = {"resources", "podSecurityContext", "securityContext"}


def test_values_yaml_documents_every_key_the_schema_knows(chart_dir):
    """Each key of values.schema.json (down to the closed sections) is in values.yaml with a
    comment directly above it, and values.yaml has no key the schema does not know."""
    schema = json.loads((chart_dir / "values.schema.json").read_text())
    lines = (chart_dir / "values.yaml").read_text().splitlines()
    with helm.Chart.load(chart_dir) as chart:
        defaults = chart.values

    def documented(key: str, indent: int) -> bool:
        for i, line in enumerate(lines):
            if line == " " * indent + f"{key}:" or line.startswith(" " * indent + f"{key}: "):
                previous = [p for p in lines[:i] if p.strip()][-1]
                return previous.strip().startswith("#")
        return False

    def check(node: dict[str, Any], values: dict[str, Any], indent: int, path: str) -> None:
        assert set(values) == set(node["properties"]), path or "top level"
        for key, sub in node["properties"].items():
            assert documented(key, indent), f"{path}{key} has no comment in values.yaml"
            closed = sub.get("additionalProperties") is False
            if closed and key not in PASSTHROUGH_SECTIONS:
                check(sub, values[key], indent + 2, f"{path}{key}.")

    check(schema, defaults, 0, "")
