"""CRDs that stand in for the APIs of KEDA, the Prometheus operator and prometheus-adapter in
the emulated cluster. Only what the operator looks for: the group/version being served and
its plural (discovery), and objects that can be stored. The custom metrics API is aggregated
in a real cluster (an APIService); the emulator has no aggregation, so a CRD in that
group/version makes it served the same way for discovery."""

from __future__ import annotations

from typing import Any

import kubernetes

STAND_INS = {
    "keda": ("keda.sh", "v1alpha1", "scaledobjects", "ScaledObject"),
    "prometheus-operator": ("monitoring.coreos.com", "v1", "podmonitors", "PodMonitor"),
    "custom-metrics": ("custom.metrics.k8s.io", "v1beta1", "metricvalues", "MetricValue"),
}


def stand_in_crd(which: str) -> dict[str, Any]:
    group, version, plural, kind = STAND_INS[which]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}",
                     "annotations": {"api-approved.kubernetes.io": "unapproved, test stand-in"}},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": kind.lower(), "kind": kind,
                      "listKind": f"{kind}List"},
            "versions": [{"name": version, "served": True, "storage": True, "schema": {
                "openAPIV3Schema": {"type": "object",
                                    "x-kubernetes-preserve-unknown-fields": True}}}],
        },
    }


def install(client: kubernetes.client.ApiClient, which: str) -> None:
    kubernetes.client.ApiextensionsV1Api(client).create_custom_resource_definition(
        stand_in_crd(which))


def get(custom: kubernetes.client.CustomObjectsApi, which: str, namespace: str,
        name: str) -> dict[str, Any] | None:
    group, version, plural, _ = STAND_INS[which]
    try:
        return dict(custom.get_namespaced_custom_object(group, version, namespace, plural, name))
    except kubernetes.client.ApiException as e:
        if e.status == 404:
            return None
        raise
