"""One pass over a service: parse, write the children, recompute the status.

No kopf here: these functions take a `Kube` and plain dicts, so the handlers stay thin. A pass
is complete and repeatable: it tries every child, collects what cannot converge (a name taken
by someone else, a child the API server rejects, a pool whose pods refuse the spec) as
`Problem`s, and publishes a status that depends only on the cluster's state, whichever handler
runs it and however often.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from baton_operator import API_VERSION, KIND
from baton_operator.apply import (
    NameConflict,
    apply,
    check_controller,
    controller_uid,
    delete_owned,
)
from baton_operator.builders import (
    ChildKey,
    autoscaling_condition,
    build_children,
    child_name,
    optional_children,
)
from baton_operator.builders.access import router_account
from baton_operator.builders.cluster_key import build_cluster_key, ensure_cluster_key
from baton_operator.capabilities import Capabilities
from baton_operator.kube import ApiError, Kube
from baton_operator.policy import PodPolicy, breaks_policy, check_policy
from baton_operator.refusal import Refusal, find_refusals, hold
from baton_operator.rollout import Decision, Live, decide, live_deployments
from baton_operator.spec import WORKER_ROLES, Images, InferenceService, InvalidSpec, parse_service
from baton_operator.status import Problem, compute_status, invalid_status, merged, same_status

REJECTED = (400, 422)  # the API server refuses what the spec renders into


@dataclass(frozen=True)
class Change:
    kind: str
    name: str
    outcome: str  # created | patched | deleted
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.outcome.capitalize()} {self.kind} {self.name}{self.detail}"


@dataclass(frozen=True)
class StatusChange:
    old: Mapping[str, Any]
    new: Mapping[str, Any]


@dataclass
class PassResult:
    """What one pass did and found."""

    invalid: str | None = None  # the spec itself can never work
    changes: list[Change] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    conflicts: list[ChildKey] = field(default_factory=list)  # names held by others
    deployments: dict[str, Mapping[str, Any]] = field(default_factory=dict)  # ours, by name
    status: StatusChange | None = None

    @property
    def outcome(self) -> str:
        """ok | invalid (the spec) | rejected (a child, by the API server) | conflict."""
        if self.invalid:
            return "invalid"
        if self.rejected:
            return "rejected"
        return "conflict" if self.conflicts else "ok"

    @property
    def rejected(self) -> list[Problem]:
        return [p for p in self.problems if p.reason == "InvalidSpec"]


def run_pass(kube: Kube, body: Mapping[str, Any], policy: PodPolicy,
             images: Images | None = None, caps: Capabilities | None = None) -> PassResult:
    """Converge the children of the service in `body` (fresh from the API) and its status;
    `images`: what its pods run unless the spec names an image; `caps`: what the cluster
    serves (KEDA, the custom metrics API, the Prometheus operator), asked this pass."""
    caps = caps or Capabilities()
    try:
        svc = parse_service(body, images)
        check_policy(svc, policy)
    except InvalidSpec as e:
        result = PassResult(invalid=str(e))
        result.status = publish_invalid(kube, body, str(e))
        return result
    refusals = find_refusals(kube, svc, caps)
    rollout = decide(kube, svc, body.get("status") or {})
    result = reconcile_children(kube, svc, policy, caps, refusals, rollout)
    result.problems += [refusal.problem() for refusal in refusals]
    pools = live_deployments(kube, svc)  # every revision's, as this pass left them
    deployments: dict[str, Mapping[str, Any] | None] = {
        "router": result.deployments.get(child_name(svc, "router")),
        **{role: merged(pools[role]) for role in WORKER_ROLES}}
    extra = autoscaling_condition(svc, caps)
    result.status = publish_status(
        kube, body, svc, deployments, result.problems, [extra] if extra else [],
        rollout=rollout.status(svc, {role: [Live.of(d) for d in ds] for role, ds in pools.items()}))
    return result


def reconcile_children(kube: Kube, svc: InferenceService, policy: PodPolicy,
                       caps: Capabilities | None = None, refusals: Sequence[Refusal] = (),
                       rollout: Decision | None = None) -> PassResult:
    """Create or restore every wanted child we may write (the worker Deployments as the
    `rollout` shapes them, the pools `refusals` hold at 0 replicas); scale the older revisions'
    Deployments as it says; delete optional ones we own and no longer want. Conflicts and
    rejections are collected; other API errors propagate."""
    result = PassResult()
    _ensure_key(kube, svc, result)
    children = build_children(svc, caps)
    if rollout is not None:
        children = rollout.shape(svc, children)
    children = hold(children, svc, refusals)
    # The router runs as the ServiceAccount this service owns; no template can name it.
    router = dataclasses.replace(
        policy, service_accounts=policy.service_accounts | {router_account(svc)})

    def untrusted(live: Mapping[str, Any]) -> bool:
        mine = router if live["metadata"]["name"] == child_name(svc, "router") else policy
        return live.get("kind") == "Deployment" and breaks_policy(live, mine)

    for child in children:
        _apply_child(kube, child, svc, untrusted, result)
    if rollout is not None:
        for name, replicas in rollout.plan.old.items():
            _scale(kube, svc, name, replicas, result)
    wanted = {(c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in children}
    done = [("apps/v1", "Deployment", name) for name in rollout.plan.delete] if rollout else []
    for api_version, kind, name in [*optional_children(svc, caps), *done]:
        if (api_version, kind, name) not in wanted and delete_owned(
                kube, api_version, kind, svc.namespace, name, svc.uid):
            result.changes.append(Change(kind, name, "deleted"))
    return result


def _scale(kube: Kube, svc: InferenceService, name: str, replicas: int,
           result: PassResult) -> None:
    """An older revision's Deployment to `replicas` (rollout.py), if we control it."""
    live = kube.get("apps/v1", "Deployment", svc.namespace, name)
    if live is None or controller_uid(live) != svc.uid:
        return
    before = (live.get("spec") or {}).get("replicas")
    if before != replicas:
        kube.patch("apps/v1", "Deployment", svc.namespace, name, {"spec": {"replicas": replicas}})
        result.changes.append(Change("Deployment", name, "patched",
                                     f" (replicas {before} -> {replicas}: rollout)"))


def _ensure_key(kube: Kube, svc: InferenceService, result: PassResult) -> None:
    """The service's cluster-key Secret (builders/cluster_key.py): created once, never
    rewritten; one held by anything else is a conflict, as for any child."""
    secret = build_cluster_key(svc)
    name = secret["metadata"]["name"]
    try:
        live, created = ensure_cluster_key(kube, svc)
        check_controller(live, secret, svc.uid)
    except NameConflict as e:
        result.problems.append(Problem("NameConflict", str(e)))
        result.conflicts.append(("v1", "Secret", name))
        return
    if created:
        result.changes.append(Change("Secret", name, "created"))


def _apply_child(kube: Kube, child: Mapping[str, Any], svc: InferenceService,
                 untrusted: Callable[[Mapping[str, Any]], bool], result: PassResult) -> None:
    kind, name = child["kind"], child["metadata"]["name"]
    try:
        applied = apply(kube, child, svc.uid, untrusted)
    except NameConflict as e:
        result.problems.append(Problem("NameConflict", str(e)))
        result.conflicts.append((child["apiVersion"], kind, name))
        return
    except ApiError as e:
        if e.status not in REJECTED:
            raise
        result.problems.append(Problem(
            "InvalidSpec", f"the API server rejected {kind} {name}: {e.message}"))
        return
    if kind == "Deployment":
        result.deployments[name] = applied.live
    if applied.outcome != "unchanged":
        result.changes.append(Change(kind, name, applied.outcome, applied.describe()))


def publish_status(kube: Kube, body: Mapping[str, Any], svc: InferenceService,
                   deployments: Mapping[str, Mapping[str, Any] | None],
                   problems: list[Problem], extra: Sequence[Mapping[str, Any]] = (),
                   rollout: Mapping[str, Any] | None = None) -> StatusChange | None:
    """Recompute the status from the pools' Deployments (only those this pass found ours:
    a name held by someone else counts as no Deployment; a worker pool's revisions merged),
    the `extra` conditions and the `rollout`'s state; write it only when it changed."""
    previous = dict(body.get("status") or {})
    new = compute_status(svc, deployments, previous, svc.generation, problems, extra=extra,
                         rollout=rollout)
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
