"""The InferenceService CRD against the operator contract: names, columns, schema, defaults."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from chart_support import errors, isvc

from tests.kube.kmock_admission import apply_defaults

POOL_DEFAULTS = {
    "replicas": 1,  # sharedMemorySize: the operator's default, 1Gi or 8Gi on a GPU
    "rolloutStrategy": {"maxSurge": "25%", "maxUnavailable": 0},
}
# Where the schema may keep unknown fields (corev1 passthroughs and kopf's own status key).
PRESERVE_UNKNOWN = {
    f"spec.{role}.{field}"
    for role in ("prefill", "decode")
    for field in ("resources", "env[]", "tolerations[]", "template")
} | {"spec.router.resources", "spec.router.env[]", "status.kopf"} | {
    f"spec.networkPolicy.{field}[].{selector}"  # metav1.LabelSelector, checked by the operator
    for field in ("routerFrom", "metricsFrom") for selector in ("podSelector", "namespaceSelector")
}


def walk(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for key, sub in schema.get("properties", {}).items():
        yield from walk(sub, f"{path}.{key}" if path else key)
    if "items" in schema:
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


def test_names_scope_and_version(crd):
    assert crd["metadata"]["name"] == "inferenceservices.baton.dev"
    spec = crd["spec"]
    assert spec["group"] == "baton.dev"
    assert spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": "InferenceService",
        "listKind": "InferenceServiceList",
        "plural": "inferenceservices",
        "singular": "inferenceservice",
        "shortNames": ["bisvc"],
        "categories": ["baton"],
    }
    [version] = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}


def test_printer_columns(crd):
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    ready = '.status.conditions[?(@.type=="Ready")]'
    assert [(c["name"], c["type"], c["jsonPath"], c.get("priority", 0)) for c in columns] == [
        ("Ready", "string", f"{ready}.status", 0),
        ("Reason", "string", f"{ready}.reason", 0),
        ("Phase", "string", ".status.phase", 0),
        ("Prefill", "integer", ".status.prefill.readyReplicas", 0),
        ("Prefill-Desired", "integer", ".status.prefill.desiredReplicas", 0),
        ("Decode", "integer", ".status.decode.readyReplicas", 0),
        ("Decode-Desired", "integer", ".status.decode.desiredReplicas", 0),
        ("Router", "integer", ".status.router.readyReplicas", 0),
        ("Rollout", "string", ".status.rollout.phase", 0),
        ("Prefill-Rollout", "string", ".status.rollout.prefill", 0),
        ("Decode-Rollout", "string", ".status.rollout.decode", 0),
        ("URL", "string", ".status.url", 0),
        ("Age", "date", ".metadata.creationTimestamp", 0),
        ("Model", "string", ".spec.model.uri", 1),
        ("KV", "string", ".spec.kvTransfer.backend", 1),
        ("Policy", "string", ".spec.router.policy", 1),
        ("Prefill-TP", "integer", ".status.prefill.tensorParallelSize", 1),
        ("Decode-TP", "integer", ".status.decode.tensorParallelSize", 1),
        ("Recommended", "string", ".status.planner.recommended", 1),
        ("Revision", "string", ".status.rollout.revision", 1),
    ]


def test_schema_is_structural(crd_schema):
    """Every node has a type (or is int-or-string with the one allowed anyOf), and unknown
    fields survive only where the contract passes Kubernetes types through."""
    jsonschema.Draft7Validator.check_schema(crd_schema)
    preserved = set()
    for path, node in walk(crd_schema):
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, path
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        else:
            assert node.get("type") in {"object", "array", "string", "integer", "number",
                                        "boolean"}, path
        if node.get("x-kubernetes-preserve-unknown-fields"):
            preserved.add(path)
        if "default" in node:  # the API server requires defaults to validate
            assert errors(node, node["default"]) == [], path
    assert preserved == PRESERVE_UNKNOWN


def test_defaults_follow_the_contract(crd_schema):
    obj = apply_defaults(isvc({"model": {"uri": "builtin:smollm2-135m"}}), crd_schema)
    assert obj["spec"] == {
        "model": {"uri": "builtin:smollm2-135m"},  # image: the operator's (chart values)
        "imagePullPolicy": "IfNotPresent",
        "prefill": POOL_DEFAULTS,
        "decode": POOL_DEFAULTS,
        "router": {"replicas": 1, "policy": "cache_aware", "fallback": "fail",
                   "discovery": "kubernetes"},
        "kvTransfer": {"backend": "nixl"},
        "networkPolicy": {"enabled": True},
    }
    obj = apply_defaults(
        isvc(
            {
                "model": {"uri": "hf://org/name", "tokenSecretRef": {"name": "hf"}},
                "autoscaling": {"decode": {"min": 1, "max": 4}},
            }
        ),
        crd_schema,
    )
    assert obj["spec"]["model"]["tokenSecretRef"] == {"name": "hf", "key": "token"}
    assert obj["spec"]["autoscaling"] == {
        "decode": {"min": 1, "max": 4, "metric": "kv"}  # the target: the operator's per metric
    }


def test_sample_validates(crd_schema, sample):
    assert sample["apiVersion"] == "baton.dev/v1alpha1"
    assert sample["kind"] == "InferenceService"
    assert errors(crd_schema, sample) == []
    spec = sample["spec"]
    assert spec["model"]["uri"] == "builtin:smollm2-135m"
    assert [spec[role]["replicas"] for role in ("prefill", "decode", "router")] == [1, 1, 1]


def test_full_spec_validates(crd_schema):
    spec = {
        "model": {
            "uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct",
            "servedName": "smollm2",
            "tokenSecretRef": {"name": "hf-token", "key": "HF_TOKEN"},
        },
        "image": "registry.example.com/baton:0.1.0",
        "imagePullPolicy": "Always",
        "prefill": {
            "replicas": 2,
            "resources": {"limits": {"nvidia.com/gpu": 1}, "requests": {"cpu": "2"}},
            "args": ["--max-running-requests", "8"],
            "env": [{"name": "UCX_TLS", "value": "tcp"}, {"name": "A", "valueFrom": {}}],
            "nodeSelector": {"pool": "gpu"},
            "tolerations": [{"key": "gpu", "operator": "Exists"}],
            "sharedMemorySize": 2147483648,
            "rolloutStrategy": {"maxSurge": 1, "maxUnavailable": "10%"},
            "template": {"metadata": {"annotations": {"a": "b"}}, "spec": {"containers": []}},
        },
        "decode": {"replicas": 0, "sharedMemorySize": "512Mi"},
        "router": {"replicas": 2, "policy": "prefix", "args": ["--x"], "env": [{"name": "B"}]},
        "kvTransfer": {"backend": "tcp"},
        "ingress": {"host": "llm.example.com", "className": "nginx", "tls": {"secretName": "t"}},
        "autoscaling": {
            "prefill": {"min": 1, "max": 3, "metric": "memory", "target": 60},
            "decode": {"min": 2, "max": 8},
        },
    }
    assert errors(crd_schema, isvc(spec)) == []
    for uri in ("pvc://models/smollm2", "file:///srv/models/smollm2", "builtin:smollm2-135m"):
        assert errors(crd_schema, isvc({"model": {"uri": uri}})) == []


def test_status_validates(crd_schema):
    obj = isvc({"model": {"uri": "builtin:smollm2-135m"}})
    obj["status"] = {
        "phase": "Ready",
        "observedGeneration": 3,
        "url": "http://x.default.svc.cluster.local:8000",
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "AllReplicasReady",
                "message": "",
                "lastTransitionTime": "2026-11-22T00:00:00Z",
                "observedGeneration": 3,
            }
        ],
        "prefill": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1,
                    "desiredReplicas": 1},
        "decode": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1},
        "router": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1},
        "kopf": {"progress": {}},
    }
    assert errors(crd_schema, obj) == []
    obj["status"]["conditions"][0]["status"] = "Yes"
    assert errors(crd_schema, obj) == [
        "status.conditions.0.status: 'Yes' is not one of ['True', 'False', 'Unknown']"
    ]


def test_bad_sample_is_rejected(crd_schema, sample):
    bad = copy.deepcopy(sample)
    bad["spec"]["kvTransfer"] = {"backend": "rdma"}
    bad["spec"]["decode"]["replicas"] = -1
    del bad["spec"]["model"]["uri"]
    assert errors(crd_schema, bad) == [
        "spec.decode.replicas: -1 is less than the minimum of 0",
        "spec.kvTransfer.backend: 'rdma' is not one of ['nixl', 'tcp']",
        "spec.model: 'uri' is a required property",
    ]


@pytest.mark.parametrize(
    ("spec", "where"),
    [
        ({}, "'model' is a required property"),
        ({"model": {"uri": "s3://bucket/model"}}, "spec.model.uri"),
        ({"model": {"uri": "file://relative/path"}}, "spec.model.uri"),
        ({"model": {"uri": "builtin:x", "tokenSecretRef": {}}}, "spec.model.tokenSecretRef"),
        ({"model": {"uri": "builtin:x"}, "imagePullPolicy": "Sometimes"}, "spec.imagePullPolicy"),
        ({"model": {"uri": "builtin:x"}, "prefill": {"replicas": 1.5}}, "spec.prefill.replicas"),
        ({"model": {"uri": "builtin:x"}, "prefill": {"replicas": "1"}}, "spec.prefill.replicas"),
        ({"model": {"uri": "builtin:x"}, "router": {"policy": "random"}}, "spec.router.policy"),
        ({"model": {"uri": "builtin:x"}, "router": {"replicas": -1}}, "spec.router.replicas"),
        ({"model": {"uri": "builtin:x"}, "decode": {"args": [1]}}, "spec.decode.args.0"),
        ({"model": {"uri": "builtin:x"}, "decode": {"env": [{"value": "v"}]}}, "spec.decode.env.0"),
        (
            {"model": {"uri": "builtin:x"}, "decode": {"sharedMemorySize": "lots"}},
            "spec.decode.sharedMemorySize",
        ),
        (
            {"model": {"uri": "builtin:x"}, "decode": {"rolloutStrategy": {"maxSurge": "3"}}},
            "spec.decode.rolloutStrategy.maxSurge",
        ),
        (
            {"model": {"uri": "builtin:x"}, "decode": {"rolloutStrategy": {"maxSurge": True}}},
            "spec.decode.rolloutStrategy.maxSurge",
        ),
        ({"model": {"uri": "builtin:x"}, "ingress": {"className": "nginx"}}, "spec.ingress"),
        ({"model": {"uri": "builtin:x"}, "ingress": {"host": "h", "tls": {}}}, "spec.ingress.tls"),
        (
            {"model": {"uri": "builtin:x"}, "autoscaling": {"decode": {"min": 0, "max": 2}}},
            "spec.autoscaling.decode.min",
        ),
        (
            {"model": {"uri": "builtin:x"}, "autoscaling": {"prefill": {"min": 1}}},
            "spec.autoscaling.prefill",
        ),
        (
            {
                "model": {"uri": "builtin:x"},
                "autoscaling": {"prefill": {"min": 1, "max": 2, "target": 0}},
            },
            "spec.autoscaling.prefill.target",
        ),
        (
            {
                "model": {"uri": "builtin:x"},
                "autoscaling": {"prefill": {"min": 1, "max": 2, "metric": "gpu"}},
            },
            "spec.autoscaling.prefill.metric",
        ),
        (  # a prefill server makes one token per request: no inter-token latency
            {
                "model": {"uri": "builtin:x"},
                "autoscaling": {"prefill": {"min": 1, "max": 2, "metric": "itl"}},
            },
            "spec.autoscaling.prefill.metric",
        ),
        ({"model": {"uri": "builtin:x"}, "autoscaling": {"mode": "auto"}}, "spec.autoscaling.mode"),
        ({"model": {"uri": "builtin:x"}, "autoscaling": {"ttftTarget": 0, "itlTarget": 5}},
         "spec.autoscaling.ttftTarget"),
        ({"model": {"uri": "builtin:x"}, "autoscaling": {"cooldownSeconds": -5}},
         "spec.autoscaling.cooldownSeconds"),
    ],
)
def test_invalid_specs_are_rejected(crd_schema, spec, where):
    found = errors(crd_schema, isvc(spec))
    assert found, f"accepted {spec}"
    assert any(where in e for e in found), found


def test_a_planner_spec_validates_and_its_rules_are_cel(crd_schema):
    """mode planner with both targets, a cooldown and both pools' bounds passes the schema;
    the rules that tie keys together are CEL (the API server's), the operator's own checks
    (tests/operator/test_operator_planning.py) say the same."""
    spec = {"model": {"uri": "builtin:x"},
            "autoscaling": {"mode": "planner", "ttftTarget": 500, "itlTarget": 60,
                            "cooldownSeconds": 30, "prefill": {"min": 1, "max": 4},
                            "decode": {"min": 1, "max": 3}}}
    assert errors(crd_schema, isvc(spec)) == []
    node = crd_schema["properties"]["spec"]["properties"]["autoscaling"]
    rules = [rule["rule"] for rule in node["x-kubernetes-validations"]]
    assert any("self.mode != 'planner'" in rule and "has(self.decode)" in rule for rule in rules)
    assert "has(self.ttftTarget) == has(self.itlTarget)" in rules
    planner = crd_schema["properties"]["status"]["properties"]["planner"]["properties"]
    assert set(planner["prefill"]["properties"]) == {"recommended", "replicas", "met", "why",
                                                     "action"}


def test_autoscaling_min_not_above_max_is_a_cel_rule(crd_schema):
    # CEL (x-kubernetes-validations) runs in the API server only; check the rule is declared.
    for role in ("prefill", "decode"):
        node = crd_schema["properties"]["spec"]["properties"]["autoscaling"]["properties"][role]
        assert node["x-kubernetes-validations"] == [
            {"rule": "self.min <= self.max", "message": "min must not exceed max"},
            {"rule": "!has(self.target) || self.target <= 100 || "
                     "self.metric in ['queue', 'ttft', 'itl']",
             "message": "cpu, memory and kv targets are percentages (1..100)"},
        ]
        assert node["properties"]["metric"]["default"] == {"prefill": "queue",
                                                            "decode": "kv"}[role]
