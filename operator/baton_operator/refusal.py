"""A worker pool whose pods refuse their configuration: found in the pods, reported, held at 0.

`baton serve` exits 2 when its configuration can never work (an architecture or quantization
it does not run, a tensor-parallel split the model cannot take, a flag it does not accept) and
writes why to the container's termination message (runtime/termination.py; with
`terminationMessagePolicy: FallbackToLogsOnError` the kubelet takes the log's tail when nothing
was written). Restarting cannot help, so instead of a crash loop:
- each pass reads the pods of every worker pool that is not available (by the pool's selector
  labels; a healthy pool costs no read). A container that runs the pool's current command (its
  image, command, args and env as rendered now: a pod of an older spec says nothing about this
  one) and terminated with exit code 2, now or before its last restart, is a `Refusal`;
- a refused pool with no ready pod and a replica count of its own is held at 0 replicas (a
  crash-looping pod keeps its node's GPU): its Deployment carries the refusal and the service's
  generation in the NOT_SERVABLE annotation, which later passes read once the pods are gone;
- a pool that has ready pods (an update whose new pods refuse while the previous ones serve) or
  that an autoscaler sizes is not scaled: the refusal is reported while its pods show it;
- a new generation (any spec change) ends a hold: the Deployment is rendered as usual, the
  annotation is removed, and the pods start again.
The status reports each refusal as a `Problem` with reason REASON (status.py).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from baton_operator.apply import controller_uid, covers
from baton_operator.builders import build_deployment, selector_labels
from baton_operator.builders.common import deployment_name
from baton_operator.builders.pods import CONTAINER, spec_revision
from baton_operator.capabilities import Capabilities
from baton_operator.kube import Kube
from baton_operator.spec import WORKER_ROLES, InferenceService, WorkerRole
from baton_operator.status import PoolState, Problem

REASON = "ModelNotServable"
EXIT_REFUSED = 2  # runtime/termination.py: the configuration can never work
NOT_SERVABLE = "baton.dev/not-servable"  # on a held Deployment: {"generation", "message"}
RUN_FIELDS = ("image", "command", "args", "env")  # what a container runs
MAX_MESSAGE = 1024  # of a termination message (a log's tail: its end says why)


@dataclass(frozen=True)
class Refusal:
    role: WorkerRole
    message: str  # the container's termination message
    held: bool  # the pool is (to be) scaled to 0 until the spec changes

    def problem(self) -> Problem:
        then = ("held at 0 replicas until the spec changes" if self.held
                else "its pods keep restarting")
        return Problem(REASON, f"{self.role}: {self.message} ({then})", role=self.role)


def find_refusals(kube: Kube, svc: InferenceService,
                  caps: Capabilities | None = None) -> list[Refusal]:
    """The worker pools of `svc` whose pods refuse the current spec (or that are held)."""
    found = (_pool_refusal(kube, svc, role, caps) for role in WORKER_ROLES)
    return [refusal for refusal in found if refusal is not None]


def hold(children: Sequence[dict[str, Any]], svc: InferenceService,
         refusals: Sequence[Refusal]) -> list[dict[str, Any]]:
    """`children` with the Deployment of each held pool at 0 replicas, the refusal noted."""
    held = {deployment_name(svc, r.role, spec_revision(svc)): r for r in refusals if r.held}
    out = []
    for child in children:
        refusal = held.get(child["metadata"]["name"]) if child["kind"] == "Deployment" else None
        if refusal is not None:
            child = copy.deepcopy(child)
            child["spec"]["replicas"] = 0
            note = json.dumps({"generation": svc.generation, "message": refusal.message})
            child["metadata"].setdefault("annotations", {})[NOT_SERVABLE] = note
        out.append(child)
    return out


def held_message(deployment: Mapping[str, Any], generation: int) -> str | None:
    """The refusal a Deployment was held for at this `generation` (None: not held for it)."""
    note = ((deployment.get("metadata") or {}).get("annotations") or {}).get(NOT_SERVABLE)
    try:
        held = json.loads(note) if note else {}
    except ValueError:
        return None
    if not isinstance(held, dict) or held.get("generation") != generation:
        return None
    return str(held.get("message") or "")


def refused_message(pod: Mapping[str, Any], container: Mapping[str, Any]) -> str | None:
    """Why `pod` refused, when its container named like `container` runs what `container`
    says and terminated with EXIT_REFUSED (now, or before its last restart)."""
    name = container["name"]
    ran = next((c for c in (pod.get("spec") or {}).get("containers") or []
                if c.get("name") == name), None)
    if ran is None or not all(covers(ran.get(f), container[f]) for f in RUN_FIELDS
                              if f in container):
        return None
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") != name:
            continue
        for state in (status.get("state"), status.get("lastState")):
            ended = (state or {}).get("terminated") or {}
            if ended.get("exitCode") == EXIT_REFUSED:
                return _message(ended)
    return None


def _pool_refusal(kube: Kube, svc: InferenceService, role: WorkerRole,
                  caps: Capabilities | None) -> Refusal | None:
    live = kube.get("apps/v1", "Deployment", svc.namespace,
                    deployment_name(svc, role, spec_revision(svc)))
    if live is None or controller_uid(live) != svc.uid:
        return None  # not yet made, or not ours (a NameConflict)
    message = held_message(live, svc.generation)
    if message is not None:
        return Refusal(role, message, held=True)
    pool = PoolState.from_deployment(role, live, 0)
    if pool.available:
        return None
    container = main_container(build_deployment(svc, role, caps))
    pods = kube.select("v1", "Pod", svc.namespace, selector_labels(svc, role))
    message = next((m for pod in pods if (m := refused_message(pod, container))), None)
    if message is None:
        return None
    return Refusal(role, message, held=pool.ready == 0 and role not in svc.autoscaling)


def main_container(deployment: Mapping[str, Any]) -> Mapping[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == CONTAINER)


def _message(ended: Mapping[str, Any]) -> str:
    text = str(ended.get("message") or "").strip()
    if not text:
        return ("the container exited with code 2 (a configuration it refuses) and left no "
                "termination message: its log says why")
    return text if len(text) <= MAX_MESSAGE else "..." + text[-MAX_MESSAGE:]
