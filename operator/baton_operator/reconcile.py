"""One reconcile pass: children from the spec, then status from the children.

No kopf here: these functions take a `Kube` and plain dicts, so the handlers stay thin.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from baton_operator import API_VERSION, KIND
from baton_operator.builders import build_children, child_name, optional_children
from baton_operator.kube import Kube, apply, delete_owned
from baton_operator.spec import ROLES, InferenceService
from baton_operator.status import compute_status, condition, invalid_status, same_status


@dataclass(frozen=True)
class Change:
    kind: str
    name: str
    outcome: str  # created | patched | deleted

    def __str__(self) -> str:
        return f"{self.outcome.capitalize()} {self.kind} {self.name}"


@dataclass(frozen=True)
class StatusChange:
    old: Mapping[str, Any]
    new: Mapping[str, Any]

    @property
    def ready_flipped(self) -> bool:
        return condition(self.old, "Ready").get("status") != condition(self.new, "Ready")["status"]


class Locks:
    """One lock per service: reconciles, timers and child events of a service never overlap,
    so the last status write is always computed from the freshest children."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[tuple[str, str], threading.Lock] = {}

    def hold(self, namespace: str, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((namespace, name), threading.Lock())


def reconcile_children(kube: Kube, svc: InferenceService) -> list[Change]:
    """Create or patch every wanted child, delete optional children no longer wanted."""
    changes = []
    children = build_children(svc)
    for child in children:
        outcome = apply(kube, child, svc.uid)
        if outcome != "unchanged":
            changes.append(Change(child["kind"], child["metadata"]["name"], outcome))
    wanted = {(c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in children}
    for api_version, kind, name in optional_children(svc):
        if (api_version, kind, name) not in wanted and delete_owned(
                kube, api_version, kind, svc.namespace, name, svc.uid):
            changes.append(Change(kind, name, "deleted"))
    return changes


def read_deployments(kube: Kube, svc: InferenceService) -> dict[str, dict[str, Any] | None]:
    return {role: kube.get("apps/v1", "Deployment", svc.namespace, child_name(svc, role))
            for role in ROLES}


def publish_status(kube: Kube, body: Mapping[str, Any], svc: InferenceService,
                   observed_generation: int) -> StatusChange | None:
    """Recompute the status from the children; write it only when it changed."""
    previous = dict(body.get("status") or {})
    new = compute_status(svc, read_deployments(kube, svc), previous, observed_generation)
    return _write(kube, svc.namespace, svc.name, previous, new)


def publish_invalid(kube: Kube, body: Mapping[str, Any], message: str) -> StatusChange | None:
    meta = body["metadata"]
    previous = dict(body.get("status") or {})
    new = invalid_status(message, int(meta.get("generation") or 1), previous)
    return _write(kube, meta.get("namespace") or "default", meta["name"], previous, new)


def owner_of(child: Mapping[str, Any]) -> str | None:
    """Name of the InferenceService controlling a child, if any."""
    for ref in (child.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == KIND and ref.get("apiVersion") == API_VERSION:
            return str(ref["name"])
    return None


def _write(kube: Kube, namespace: str, name: str, previous: Mapping[str, Any],
           new: Mapping[str, Any]) -> StatusChange | None:
    if same_status(new, previous):
        return None
    kube.patch(API_VERSION, KIND, namespace, name, {"status": new}, subresource="status")
    return StatusChange(previous, new)
