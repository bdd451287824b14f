"""kopf handlers: thin glue between kopf's causes and one pass of `reconcile.run_pass`.

Every cause runs the same complete pass over the service, reading it afresh:
- create / update / resume of an InferenceService;
- any event of a child (Deployment, Service, Ingress, HPA, PDB, NetworkPolicy, the router's
  ServiceAccount, Role and RoleBinding, a ScaledObject, a PodMonitor), including its deletion, so a
  hand edit or a deleted child is restored within seconds; and any event of an object that
  holds a child's name (a NameConflict clears as soon as it is deleted);
- a container of a worker pod ending with exit code 2, the runtime's refusal of its
  configuration (refusal.py): the pass reports it and holds the pool instead of a crash loop;
- a resync timer, the safety net for anything missed.
A second timer runs the P:D planner (planning.py) for the services with planner targets; under
`mode: planner` a plan that changes a pool's replicas runs the pass that renders them.
A spec that can never work gets Ready=False/InvalidSpec and a PermanentError (no retries);
API trouble becomes a TemporaryError and kopf retries after a delay (a child event's pass,
which kopf does not retry, is run again by `Retries`). Each pass asks the API's
discovery what the cluster serves (capabilities.py) and counts itself in the operator's
metrics (metrics.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import kopf
import urllib3

from baton_operator import API_VERSION, FINALIZER, GROUP, KIND, MANAGER, PLURAL, VERSION
from baton_operator.apply import replacement
from baton_operator.builders.common import LABEL_INSTANCE, LABEL_MANAGED_BY
from baton_operator.capabilities import probe
from baton_operator.config import OperatorConfig
from baton_operator.gates import Claims, Gates, Retries
from baton_operator.kube import ApiError, Kube
from baton_operator.metrics import METRICS
from baton_operator.planning import Planning, router_figures
from baton_operator.reconcile import PassResult, owner_of, run_pass
from baton_operator.refusal import EXIT_REFUSED
from baton_operator.spec import InvalidSpec, parse_service
from baton_operator.status import ready_event, rollout_event

CONFIG = OperatorConfig.from_env()
LOG = logging.getLogger("baton_operator")
# (group, version, plural, kind) of every kind of child
CHILD_KINDS = (("apps", "v1", "deployments", "Deployment"), ("", "v1", "services", "Service"),
               ("networking.k8s.io", "v1", "ingresses", "Ingress"),
               ("autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler"),
               ("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget"),
               ("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy"),
               ("", "v1", "serviceaccounts", "ServiceAccount"),
               ("rbac.authorization.k8s.io", "v1", "roles", "Role"),
               ("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
               # served only where KEDA / the Prometheus operator is installed: kopf watches
               # them once their CRDs appear
               ("keda.sh", "v1alpha1", "scaledobjects", "ScaledObject"),
               ("monitoring.coreos.com", "v1", "podmonitors", "PodMonitor"))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """kopf's bookkeeping under baton.dev/ keys; one API client and gate table per process."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # kopf's log lines; our own Events say what changed
    settings.scanning.disabled = not CONFIG.cluster_scanning
    settings.watching.connect_timeout = 60
    settings.watching.server_timeout = 300
    memo.planning = Planning(time.monotonic)
    METRICS.explain = lambda: dict(memo.planning.explained)  # a copy: the timer writes it
    METRICS.serve(CONFIG.metrics_port)
    memo.kube = Kube.from_environment()
    memo.gates = Gates()
    memo.claims = Claims()
    memo.retries = Retries()


@kopf.on.cleanup()
def stop_retries(memo: kopf.Memo, **_: Any) -> None:
    memo.retries.cancel()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """Converge the children on the spec, then publish the status (idempotent)."""
    result = _pass(memo, namespace or "default", name, skippable=False)
    if result is not None and result.invalid:
        raise kopf.PermanentError(f"Invalid spec: {result.invalid}")
    if result is not None and result.rejected:
        raise kopf.PermanentError("; ".join(p.message for p in result.rejected))


@kopf.timer(GROUP, VERSION, PLURAL, interval=CONFIG.resync_seconds,
            initial_delay=CONFIG.resync_seconds)
def resync(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """The same pass every `resync_seconds`, whatever happened in between."""
    _pass(memo, namespace or "default", name, skippable=True)


def has_planner_targets(spec: kopf.Spec, **_: Any) -> bool:
    autoscaling = spec.get("autoscaling")
    return isinstance(autoscaling, Mapping) and "ttftTarget" in autoscaling


@kopf.timer(GROUP, VERSION, PLURAL, interval=CONFIG.plan_seconds,
            initial_delay=CONFIG.plan_seconds, when=has_planner_targets)
def plan_pools(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """The P:D planner's turn: the router's figures, the plan, status.planner and the metric;
    under mode: planner, the pass that renders a changed plan into the Deployments."""
    namespace = namespace or "default"
    with _api_errors():
        body = memo.kube.get(API_VERSION, KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        try:
            svc = parse_service(body, CONFIG.images)
        except InvalidSpec:
            return  # the pass reports it
        if svc.planner is None:
            return
        decision = memo.planning.decide(svc, router_figures(memo.kube, svc))
        METRICS.set_recommended(namespace, name, decision.recommended)
        before = (body.get("status") or {}).get("planner")
        if before != decision.status:
            memo.kube.patch(API_VERSION, KIND, namespace, name,
                            {"status": {"planner": replacement(before, decision.status)}},
                            subresource="status")
    if any(svc.planned_replicas(role) != n or role not in svc.planned
           for role, n in decision.replicas.items()):
        LOG.info("%s/%s: the planner sets %s", namespace, name, ", ".join(
            f"{role} {n}" for role, n in decision.replicas.items()))
        _pass_or_retry(memo, namespace, name)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def forget(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """A deleted service leaves the operator's metrics and the planner's memory (its children
    go by garbage collection)."""
    METRICS.forget(namespace or "default", name)
    memo.planning.forget(namespace or "default", name)


def child_handler(kind: str) -> Callable[..., None]:
    def child_changed(body: kopf.Body, name: str | None, namespace: str | None,
                      memo: kopf.Memo, **_: Any) -> None:
        """A child, or an object holding a child's name, changed or went away: run its
        owner's pass now (restores drift, recreates what was deleted, refreshes status)."""
        if name is None or namespace is None:
            return
        owner = owner_of(body) or memo.claims.waiting_for(namespace, kind, name)
        if owner is not None:
            _pass_or_retry(memo, namespace, owner)

    return child_changed


def exited_refused(status: kopf.Status, **_: Any) -> bool:
    """A container of the pod terminated with the runtime's refusal, now or before its last
    restart (which of its pools and specs it concerns, the pass decides)."""
    return any(((state or {}).get("terminated") or {}).get("exitCode") == EXIT_REFUSED
               for container in status.get("containerStatuses") or []
               for state in (container.get("state"), container.get("lastState")))


@kopf.on.event("", "v1", "pods", labels={LABEL_MANAGED_BY: MANAGER}, when=exited_refused)
def pod_refused(labels: kopf.Labels, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    """A pool's pod refuses its configuration: its service's pass reports it now, not at the
    next resync."""
    owner = labels.get(LABEL_INSTANCE)
    if owner is not None and namespace is not None:
        _pass_or_retry(memo, namespace, owner)


def _pass_or_retry(memo: kopf.Memo, namespace: str, name: str) -> None:
    """An event's pass; after an API error, the same pass again in `retry_seconds`."""
    try:
        _pass(memo, namespace, name, skippable=True)
    except kopf.TemporaryError as e:
        LOG.warning("%s/%s: %s; next pass in %gs", namespace, name, e, CONFIG.retry_seconds)
        memo.retries.later((namespace, name), CONFIG.retry_seconds,
                           lambda: _pass_or_retry(memo, namespace, name))


for _group, _version, _plural, _kind in CHILD_KINDS:
    kopf.on.event(_group, _version, _plural, id=f"child-{_plural}")(child_handler(_kind))


def _pass(memo: kopf.Memo, namespace: str, name: str, *, skippable: bool) -> PassResult | None:
    with memo.gates.turn((namespace, name), skippable=skippable) as mine:
        if not mine:
            return None
        started = time.monotonic()
        with _api_errors():
            body = memo.kube.get(API_VERSION, KIND, namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                memo.claims.update(namespace, name, [])
                METRICS.forget(namespace, name)
                return None
            caps = probe(memo.kube, CONFIG.prometheus_url)
            result = run_pass(memo.kube, body, CONFIG.policy, CONFIG.images, caps)
    METRICS.on_pass(result.outcome, time.monotonic() - started)
    status = result.status.new if result.status is not None else body.get("status") or {}
    METRICS.set_phase(namespace, name, str(status.get("phase")))
    memo.claims.update(namespace, name, result.conflicts)
    _report(body, result)
    return result


def _report(body: Mapping[str, Any], result: PassResult) -> None:
    """Log and post an Event for each child written, for a readiness change and for a
    rollout's gate and end."""
    for change in result.changes:
        LOG.info("%s/%s: %s", body["metadata"].get("namespace"), body["metadata"]["name"], change)
        _event(body, "Normal", change.outcome.capitalize(), str(change))
    if result.status is not None:
        for event in (ready_event(result.status.old, result.status.new),
                      rollout_event(result.status.old, result.status.new)):
            if event is not None:
                _event(body, *event)


def _event(body: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
    """A Kubernetes Event about the service (kopf posts it in the background)."""
    kopf.event(kopf.Body(cast(kopf.RawBody, dict(body))), type=kind, reason=reason,
               message=message)


@contextmanager
def _api_errors() -> Iterator[None]:
    """Map API failures to kopf's retry semantics."""
    try:
        yield
    except ApiError as e:
        METRICS.errors.inc()
        raise kopf.TemporaryError(f"Kubernetes API: {e}", delay=CONFIG.retry_seconds) from e
    except urllib3.exceptions.HTTPError as e:
        METRICS.errors.inc()
        raise kopf.TemporaryError(f"Kubernetes API unreachable: {e}",
                                  delay=CONFIG.retry_seconds) from e
