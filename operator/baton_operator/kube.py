"""A small Kubernetes REST client speaking plain dicts (create-or-restore lives in apply.py).

It rides on the `kubernetes` package's ApiClient for configuration, auth and TLS, but keeps
bodies as JSON dicts end to end: the builders produce dicts and the status logic reads them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import kubernetes

from baton_operator import API_VERSION, KIND, PLURAL

PLURALS: dict[tuple[str, str], str] = {
    ("v1", "Service"): "services",
    ("apps/v1", "Deployment"): "deployments",
    ("networking.k8s.io/v1", "Ingress"): "ingresses",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Secret"): "secrets",
    ("v1", "Pod"): "pods",  # read only: why a pool's containers exit (refusal.py)
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobjects",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors",
    (API_VERSION, KIND): PLURAL,
}
UNSERVED = (404, 503)  # discovery: no such group/version, or its aggregated backend is down


class ApiError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class Kube:
    """Namespaced GET/POST/PATCH/DELETE on the kinds in `PLURALS`, returning dicts."""

    def __init__(self, api: kubernetes.client.ApiClient, timeout: float = 30.0) -> None:
        self.api = api
        self.timeout = timeout

    @classmethod
    def from_environment(cls) -> Kube:
        """In-cluster service account if there is one, else the kubeconfig (`$KUBECONFIG`)."""
        config = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(client_configuration=config)
        return cls(kubernetes.client.ApiClient(config))

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", _path(api_version, kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def select(self, api_version: str, kind: str, namespace: str,
               selector: Mapping[str, str]) -> list[dict[str, Any]]:
        """The objects of `kind` in `namespace` whose labels include `selector`."""
        labels = ",".join(f"{k}={v}" for k, v in selector.items())
        found = self._call("GET", _path(api_version, kind, namespace),
                           query=[("labelSelector", labels)])
        return list(found.get("items") or [])

    def discover(self, group_version: str) -> list[str] | None:
        """The resources (plurals) an API group/version serves; None when it serves none."""
        try:
            found = self._call("GET", f"/apis/{group_version}")
        except ApiError as e:
            if e.status in UNSERVED:
                return None
            raise
        return [str(r.get("name")) for r in found.get("resources") or []]

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return self._call("POST", _path(obj["apiVersion"], obj["kind"], meta["namespace"]), obj)

    def patch(self, api_version: str, kind: str, namespace: str, name: str,
              patch: Mapping[str, Any], subresource: str | None = None) -> dict[str, Any]:
        """JSON merge patch (RFC 7386): mappings merge, lists are replaced, null deletes."""
        path = _path(api_version, kind, namespace, name, subresource)
        return self._call("PATCH", path, patch, "application/merge-patch+json")

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        try:
            self._call("DELETE", _path(api_version, kind, namespace, name),
                       {"propagationPolicy": "Background"})
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        return True

    def _call(self, method: str, path: str, body: Any = None,
              content_type: str = "application/json",
              query: list[tuple[str, str]] | None = None) -> dict[str, Any]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        request = self.api.param_serialize(method, path, header_params=headers, body=body,
                                           query_params=query, auth_settings=["BearerToken"])
        response = self.api.call_api(*request, _request_timeout=self.timeout)
        data = response.read()
        if not 200 <= response.status < 300:
            raise ApiError(response.status, _message(data))
        return json.loads(data) if data else {}


def _path(api_version: str, kind: str, namespace: str, name: str | None = None,
          subresource: str | None = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{PLURALS[api_version, kind]}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def _message(data: bytes) -> str:
    try:
        return str(json.loads(data).get("message", data[:200]))
    except (ValueError, AttributeError):
        return data[:200].decode(errors="replace")
