"""kopf handlers: thin glue between kopf's causes and `reconcile`.

- create / update / resume of an InferenceService: converge the children, then the status;
- a timer: the same, level-based, so drift (a deleted child) heals without any event;
- events of the child Deployments: recompute the owner's status right away.
A spec that can never work gets Ready=False/InvalidSpec and a PermanentError (no retries);
API trouble becomes a TemporaryError and kopf retries after a delay.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import kopf
import urllib3

from baton_operator import FINALIZER, GROUP, KIND, MANAGER, PLURAL, VERSION
from baton_operator.builders.common import LABEL_MANAGED_BY
from baton_operator.config import OperatorConfig
from baton_operator.kube import ApiError, Kube, OwnershipConflict
from baton_operator.reconcile import (
    Locks,
    StatusChange,
    owner_of,
    publish_invalid,
    publish_status,
    reconcile_children,
)
from baton_operator.spec import InferenceService, InvalidSpec, parse_service
from baton_operator.status import condition

CONFIG = OperatorConfig.from_env()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """kopf's bookkeeping under baton.dev/ keys; one API client and lock table per process."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # kopf's log lines; our own Events say what changed
    settings.watching.connect_timeout = 60
    settings.watching.server_timeout = 300
    memo.kube = Kube.from_environment()
    memo.locks = Locks()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Converge the children on the spec, then publish the status (idempotent)."""
    raw = copy.deepcopy(dict(body))
    with memo.locks.hold(*_key(raw)), _api_errors(memo.kube, raw):
        svc = _parse_or_fail(memo.kube, raw)
        _converge(memo.kube, raw, svc, logger)


@kopf.timer(GROUP, VERSION, PLURAL, interval=CONFIG.resync_seconds,
            initial_delay=CONFIG.resync_seconds)
def resync(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """The same convergence every `resync_seconds`: recreates lost children, fixes status."""
    raw = copy.deepcopy(dict(body))
    with memo.locks.hold(*_key(raw)), _api_errors(memo.kube, raw):
        fresh = memo.kube.get(raw["apiVersion"], KIND, *_key(raw))
        if fresh is None or fresh["metadata"].get("deletionTimestamp"):
            return
        try:
            svc = parse_service(fresh)
        except InvalidSpec:
            return  # already reported by the reconcile handler
        _converge(memo.kube, fresh, svc, logger)


@kopf.on.event("apps", "v1", "deployments", labels={LABEL_MANAGED_BY: MANAGER})
def child_changed(body: kopf.Body, namespace: str | None, memo: kopf.Memo,
                  logger: kopf.Logger, **_: Any) -> None:
    """A child Deployment changed (rollout, pods ready): refresh its owner's status now."""
    owner = owner_of(body)
    if owner is None or namespace is None:
        return
    with memo.locks.hold(namespace, owner):
        try:
            _refresh(memo.kube, namespace, owner)
        except (ApiError, urllib3.exceptions.HTTPError) as e:
            logger.warning(f"Could not refresh the status of {namespace}/{owner}: {e}")


def _converge(kube: Kube, raw: Mapping[str, Any], svc: InferenceService,
              logger: kopf.Logger) -> None:
    for change in reconcile_children(kube, svc):
        logger.info(str(change))
        _event(raw, "Normal", change.outcome.capitalize(), str(change))
    fresh = kube.get(raw["apiVersion"], KIND, svc.namespace, svc.name) or raw  # latest status
    _announce(raw, publish_status(kube, fresh, svc, svc.generation))


def _refresh(kube: Kube, namespace: str, name: str) -> None:
    """Status of a service after one of its Deployments changed (never its children)."""
    raw = kube.get(f"{GROUP}/{VERSION}", KIND, namespace, name)
    if raw is None or raw["metadata"].get("deletionTimestamp"):
        return
    observed = (raw.get("status") or {}).get("observedGeneration")
    if observed is None:
        return  # not reconciled yet: the create handler publishes the first status
    try:
        svc = parse_service(raw)
    except InvalidSpec:
        return
    _announce(raw, publish_status(kube, raw, svc, int(observed)))


def _parse_or_fail(kube: Kube, raw: Mapping[str, Any]) -> InferenceService:
    try:
        return parse_service(raw)
    except InvalidSpec as e:
        _announce(raw, publish_invalid(kube, raw, str(e)))
        raise kopf.PermanentError(f"Invalid spec: {e}") from e


def _announce(raw: Mapping[str, Any], change: StatusChange | None) -> None:
    """A Kubernetes Event when readiness flips."""
    if change is None or not change.ready_flipped:
        return
    ready = condition(change.new, "Ready")
    if ready["status"] == "True":
        _event(raw, "Normal", "Ready", ready.get("message", ""))
    else:
        _event(raw, "Warning", ready.get("reason", "NotReady"), ready.get("message", ""))


def _event(raw: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
    """A Kubernetes Event about the service (kopf posts it in the background)."""
    body = kopf.Body(cast(kopf.RawBody, dict(raw)))
    kopf.event(body, type=kind, reason=reason, message=message)


@contextmanager
def _api_errors(kube: Kube, raw: Mapping[str, Any]) -> Iterator[None]:
    """Map API failures to kopf's retry semantics."""
    try:
        yield
    except OwnershipConflict as e:
        _event(raw, "Warning", "NameConflict", str(e))
        raise kopf.TemporaryError(str(e), delay=4 * CONFIG.retry_seconds) from e
    except ApiError as e:
        if e.status in (400, 422):  # the API server rejects what the spec renders into
            _announce(raw, publish_invalid(kube, raw, f"rejected by the API server: {e}"))
            raise kopf.PermanentError(f"Invalid spec: {e}") from e
        raise kopf.TemporaryError(f"Kubernetes API: {e}", delay=CONFIG.retry_seconds) from e
    except urllib3.exceptions.HTTPError as e:
        raise kopf.TemporaryError(f"Kubernetes API unreachable: {e}",
                                  delay=CONFIG.retry_seconds) from e


def _key(raw: Mapping[str, Any]) -> tuple[str, str]:
    meta = raw["metadata"]
    return meta.get("namespace") or "default", meta["name"]
