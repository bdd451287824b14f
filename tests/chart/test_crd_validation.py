"""The CRD refuses what the operator refuses (the API server's check comes first, the
operator's is the same for a cluster that did not run it): model URIs, Ingress hosts,
int32 replica counts and the name rule."""

from __future__ import annotations

import re

import pytest
from baton_operator.checks import DNS_LABEL, INT32_MAX
from baton_operator.spec import InvalidSpec, parse_service
from chart_support import errors, isvc


def spec_path(crd_schema, *path):
    node = crd_schema["properties"]["spec"]
    for key in path:
        node = node["properties"][key]
    return node


URIS = ["builtin:smollm2-135m", "builtin:", "builtin:-x", "hf://org/name", "hf://org",
        "hf://a/b/c", "hf://org/na me", "pvc://claim", "pvc://claim/", "pvc://claim/a/b",
        "pvc://claim//a", "pvc://claim/../etc", "pvc://claim/a/./b", "pvc://Bad_Claim/x",
        "pvc://a..b/x", "pvc://claim/.hidden/..x", "file:///srv/models", "file:////srv/m/",
        "file:///", "file:///.", "file:///srv/../etc", "file://relative", "s3://b/m", ""]
HOSTS = ["llm.example.com", "*.example.com", "a", "Bad_Host!", "a..b", "-a.com", "a.-b",
         "UPPER.example.com", "*.*.example.com", "a" * 254]
NAMES = ["llm", "a" * 55, "a" * 56, "Upper", "9lives", "a-", "a.b", "a-b-c"]


def operator_accepts(spec):
    try:
        parse_service({"metadata": {"name": "x"}, "spec": spec})
    except InvalidSpec:
        return False
    return True


@pytest.mark.parametrize("uri", URIS)
def test_the_crd_refuses_the_model_uris_the_operator_refuses(crd_schema, uri):
    crd_ok = not errors(crd_schema, isvc({"model": {"uri": uri}}))
    assert crd_ok == operator_accepts({"model": {"uri": uri}}), uri


@pytest.mark.parametrize("host", HOSTS)
def test_the_crd_refuses_the_ingress_hosts_the_operator_refuses(crd_schema, host):
    spec = {"model": {"uri": "builtin:x"}, "ingress": {"host": host}}
    assert (not errors(crd_schema, isvc(spec))) == operator_accepts(spec), host


def test_replica_counts_are_int32(crd_schema):
    for role in ("prefill", "decode", "router"):
        assert spec_path(crd_schema, role, "replicas")["maximum"] == INT32_MAX
        spec = {"model": {"uri": "builtin:x"}, role: {"replicas": INT32_MAX + 1}}
        assert errors(crd_schema, isvc(spec)) and not operator_accepts(spec)
    for role in ("prefill", "decode"):
        for bound in ("min", "max"):
            node = spec_path(crd_schema, "autoscaling", role, bound)
            assert node["maximum"] == INT32_MAX


@pytest.mark.parametrize("name", NAMES)
def test_the_name_rule_is_the_operators(crd_schema, name):
    """CEL runs in the API server only; the rule must be exactly the operator's check (same
    pattern, same length), so read both out of the rule and apply them here."""
    [rule] = crd_schema["x-kubernetes-validations"]
    found = re.fullmatch(r"self\.metadata\.name\.matches\('(.+)'\) && "
                         r"size\(self\.metadata\.name\) <= (\d+)", rule["rule"])
    assert found is not None, rule["rule"]
    pattern, longest = found.group(1), int(found.group(2))
    assert pattern == DNS_LABEL.pattern
    by_rule = bool(re.match(pattern, name)) and len(name) <= longest
    try:
        parse_service({"metadata": {"name": name}, "spec": {"model": {"uri": "builtin:x"}}})
        by_operator = True
    except InvalidSpec:
        by_operator = False
    assert by_rule == by_operator, name


@pytest.mark.parametrize("tp", [0, 1, 2, 64, 65, "2", 1.5])
def test_the_crd_bounds_tensor_parallel_size_as_the_operator_does(crd_schema, tp):
    """No schema default: the operator defaults it to the pool's gpu.count, else 1."""
    for role in ("prefill", "decode"):
        assert "default" not in spec_path(crd_schema, role, "tensorParallelSize")
        spec = {"model": {"uri": "hf://org/name"}, "kvTransfer": {"backend": "tcp"},
                role: {"tensorParallelSize": tp}}
        assert (not errors(crd_schema, isvc(spec))) == operator_accepts(spec), (role, tp)


def test_tensor_parallel_size_equals_the_gpu_count_is_a_cel_rule(crd_schema):
    """CEL runs in the API server only: the rule is declared on both pools, and the operator
    refuses what it refuses (a gpu.count other than tensorParallelSize)."""
    for role in ("prefill", "decode"):
        node = spec_path(crd_schema, role)
        assert node["x-kubernetes-validations"] == [{
            "rule": "!has(self.tensorParallelSize) || !has(self.gpu) || self.tensorParallelSize"
                    " == (has(self.gpu.count) ? self.gpu.count : 1)",
            "message": "tensorParallelSize must equal gpu.count (one GPU per rank)"}]
        base = {"model": {"uri": "hf://org/name"}, "kvTransfer": {"backend": "tcp"}}
        assert not operator_accepts({**base, role: {"tensorParallelSize": 2, "gpu": {}}})
        assert not operator_accepts({**base, role: {"tensorParallelSize": 1,
                                                    "gpu": {"count": 2}}})
        assert operator_accepts({**base, role: {"tensorParallelSize": 2, "gpu": {"count": 2}}})
        assert operator_accepts({**base, role: {"gpu": {"count": 2}}})  # the default
