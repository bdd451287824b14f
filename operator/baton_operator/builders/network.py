"""Services and the optional Ingress."""

from __future__ import annotations

from typing import Any

from baton_operator.builders.common import (
    BOOTSTRAP_PORT,
    HTTP_PORT,
    child_name,
    metadata,
    selector_labels,
)
from baton_operator.spec import InferenceService, WorkerRole


def build_headless_service(svc: InferenceService, role: WorkerRole) -> dict[str, Any]:
    """Headless Service whose DNS name the router re-resolves to find the pool's ready pods."""
    ports = [_port("http", HTTP_PORT)]
    if role == "prefill":
        ports.append(_port("bootstrap", BOOTSTRAP_PORT))
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(svc, child_name(svc, role), role),
        "spec": {"clusterIP": "None", "selector": selector_labels(svc, role), "ports": ports},
    }


def build_router_service(svc: InferenceService) -> dict[str, Any]:
    """Service `<name>`: the stable in-cluster endpoint, port 8000 to the routers."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(svc, svc.name, "router"),
        "spec": {"type": "ClusterIP", "selector": selector_labels(svc, "router"),
                 "ports": [_port("http", HTTP_PORT)]},
    }


def build_ingress(svc: InferenceService) -> dict[str, Any] | None:
    """networking.k8s.io/v1 Ingress to the router Service; None when `spec.ingress` is unset."""
    ingress = svc.ingress
    if ingress is None:
        return None
    backend = {"service": {"name": svc.name, "port": {"name": "http"}}}
    spec: dict[str, Any] = {"rules": [{"host": ingress.host, "http": {"paths": [
        {"path": "/", "pathType": "Prefix", "backend": backend}]}}]}
    if ingress.class_name:
        spec["ingressClassName"] = ingress.class_name
    if ingress.tls_secret:
        spec["tls"] = [{"hosts": [ingress.host], "secretName": ingress.tls_secret}]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
            "metadata": metadata(svc, svc.name, "router"), "spec": spec}


def _port(name: str, port: int) -> dict[str, Any]:
    return {"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
