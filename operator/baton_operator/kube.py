"""A small Kubernetes REST client speaking plain dicts, plus create-or-patch of children.

It rides on the `kubernetes` package's ApiClient for configuration, auth and TLS, but keeps
bodies as JSON dicts end to end: the builders produce dicts and the status logic reads them.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any, Literal

import kubernetes

from baton_operator import API_VERSION, KIND, PLURAL

LAST_APPLIED = "baton.dev/last-applied"
# Fields another controller takes over when we stop setting them (the HPA owns replicas).
HANDED_OVER = (("spec", "replicas"),)
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "Service"): "services",
    ("apps/v1", "Deployment"): "deployments",
    ("networking.k8s.io/v1", "Ingress"): "ingresses",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    (API_VERSION, KIND): PLURAL,
}
Outcome = Literal["created", "patched", "unchanged"]


class ApiError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class OwnershipConflict(Exception):
    """A child's name is taken by an object another controller owns."""


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
              content_type: str = "application/json") -> dict[str, Any]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        request = self.api.param_serialize(method, path, header_params=headers, body=body,
                                           auth_settings=["BearerToken"])
        response = self.api.call_api(*request, _request_timeout=self.timeout)
        data = response.read()
        if not 200 <= response.status < 300:
            raise ApiError(response.status, _message(data))
        return json.loads(data) if data else {}


def apply(kube: Kube, desired: Mapping[str, Any], owner_uid: str) -> Outcome:
    """Create the child, or patch it only where our last applied manifest differs.

    The last applied manifest lives in an annotation (what `kubectl apply` does), so fields
    the API server defaults or other controllers own never cause a patch, and fields dropped
    from the manifest are removed with a null in the merge patch.
    """
    api_version, kind = desired["apiVersion"], desired["kind"]
    namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    applied = json.dumps(desired, sort_keys=True, separators=(",", ":"))
    body = copy.deepcopy(dict(desired))
    body["metadata"].setdefault("annotations", {})[LAST_APPLIED] = applied
    current = kube.get(api_version, kind, namespace, name)
    if current is None:
        try:
            kube.create(body)
            return "created"
        except ApiError as e:
            current = kube.get(api_version, kind, namespace, name) if e.status == 409 else None
            if current is None:
                raise
    _check_controller(current, desired, owner_uid)
    previous = ((current.get("metadata") or {}).get("annotations") or {}).get(LAST_APPLIED)
    if previous == applied:
        return "unchanged"
    old = json.loads(previous) if previous else {}
    for path in HANDED_OVER:
        if _lookup(desired, path) is None:
            _forget(old, path)
    kube.patch(api_version, kind, namespace, name, merge_diff(old, body))
    return "patched"


def delete_owned(kube: Kube, api_version: str, kind: str, namespace: str, name: str,
                 owner_uid: str) -> bool:
    """Delete a child we no longer want, only if we are its controller."""
    current = kube.get(api_version, kind, namespace, name)
    if current is None or _controller_uid(current) != owner_uid:
        return False
    return kube.delete(api_version, kind, namespace, name)


def merge_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that turns `old` into `new` (keys only in `old` become null)."""
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            sub = merge_diff(before, value)
            if sub:
                patch[key] = sub
        elif key not in old or before != value:
            patch[key] = copy.deepcopy(value)
    return patch


def _check_controller(current: Mapping[str, Any], desired: Mapping[str, Any], uid: str) -> None:
    for ref in (current.get("metadata") or {}).get("ownerReferences") or []:
        if not ref.get("controller") or ref.get("uid") == uid:
            continue
        ours = desired["metadata"]["ownerReferences"][0]
        if (ref.get("kind"), ref.get("name")) != (ours["kind"], ours["name"]):
            raise OwnershipConflict(
                f"{current.get('kind')} {current['metadata'].get('name')} is controlled by "
                f"{ref.get('kind')} {ref.get('name')}; delete it or rename the service")
        # Same kind and name, older uid: a previous incarnation of this service; adopt it.


def _controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def _path(api_version: str, kind: str, namespace: str, name: str | None = None,
          subresource: str | None = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{PLURALS[api_version, kind]}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def _lookup(obj: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, Mapping) or key not in obj:
            return None
        obj = obj[key]
    return obj


def _forget(obj: dict[str, Any], path: tuple[str, ...]) -> None:
    parent = _lookup(obj, path[:-1])
    if isinstance(parent, dict):
        parent.pop(path[-1], None)


def _message(data: bytes) -> str:
    try:
        return str(json.loads(data).get("message", data[:200]))
    except (ValueError, AttributeError):
        return data[:200].decode(errors="replace")
