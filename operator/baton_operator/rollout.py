"""Coordinated rollouts: a new revision replaces the serving one in both worker pools in step.

A worker pool has one Deployment per revision (`<name>-<role>-<revision>`,
builders/common.py `deployment_name`), and the router pairs a prefill only with a decode of
its revision (runtime/revision.py). A spec change that changes the revision (pods.py
`spec_revision`) therefore makes new Deployments, and this module decides, from the live
Deployments alone, how many pods each revision of each pool has:

1. **Gate** (`spec.rollout.gate: probes`, the default): while the new revision has no
   Deployment yet, the old ones keep their replicas and a probe pair of the new revision runs
   (probing.py). Only a passed gate lets the new revision start; a failed one stops here,
   with the old revision serving (`ProbeFailed`). A service whose old revision does not
   serve (the first revision; or a pool of it without a ready pod, e.g. one that refused its
   model) is not gated: there is nothing to keep serving.
2. **Steps**: with N pods per pool and K = ceil(100 / maxSkew) steps (at most the larger
   pool's size), step i wants ceil(N * i / K) new pods in each pool. A step first grows both
   new Deployments to step i; once every new pod of step i is ready in both pools, the old
   Deployments shrink to N minus that, and once their pods are gone, step i + 1 begins. So
   in each pool the ready share of new pods moves one step at a time, in both pools
   together: it leads the other pool's by at most one step (maxSkew, or one pod of the
   smaller pool when that is more), and pods are added before any are taken away.
3. **Done**: at step K with the old pods gone, the old Deployments are deleted.
Old decodes leave by SIGTERM: their drain moves each stream's KV to a decode of their own
revision (runtime/server/drain.py), else lets them finish.

The step is derived from the new Deployments' replicas, so a restarted operator goes on where
the last one stopped. Autoscalers pause during a rollout (the pool size is frozen at what it
was when the rollout began, `status.rollout.replicas`) and resume on the new revision's
Deployment.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from baton_operator.apply import controller_uid
from baton_operator.builders.common import LABEL_REVISION, deployment_name, selector_labels
from baton_operator.builders.pods import spec_revision
from baton_operator.builders.workloads import build_probe_deployment
from baton_operator.kube import Kube
from baton_operator.probing import Gate, run_gate
from baton_operator.spec import WORKER_ROLES, InferenceService, WorkerRole
from baton_operator.status import PROBE_FAILED, PROBING, ROLLING, STABLE

UNKNOWN = "unknown"  # a Deployment whose pods carry no revision (made before revisions)



@dataclass(frozen=True)
class Live:
    """One worker Deployment of the service, as the API returned it."""

    name: str
    revision: str
    desired: int  # spec.replicas
    pods: int  # status.replicas: pods that exist, terminating ones not counted
    ready: int
    created: str  # metadata.creationTimestamp (older revisions first)

    @classmethod
    def of(cls, deployment: Mapping[str, Any]) -> Live:
        meta, spec = deployment["metadata"], deployment.get("spec") or {}
        status = deployment.get("status") or {}
        labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
        return cls(name=meta["name"], revision=str(labels.get(LABEL_REVISION) or UNKNOWN),
                   desired=int(spec.get("replicas", 1)), pods=int(status.get("replicas", 0)),
                   ready=int(status.get("readyReplicas", 0)),
                   created=str(meta.get("creationTimestamp") or ""))


def live_deployments(kube: Kube, svc: InferenceService) -> dict[WorkerRole, list[dict[str, Any]]]:
    """Every worker Deployment this service controls (probe pods' aside), by pool, oldest
    first."""
    found: dict[WorkerRole, list[dict[str, Any]]] = {}
    for role in WORKER_ROLES:
        mine = [d for d in kube.select("apps/v1", "Deployment", svc.namespace,
                                       selector_labels(svc, role))
                if controller_uid(d) == svc.uid]
        found[role] = sorted(mine, key=lambda d: (str(d["metadata"].get("creationTimestamp")),
                                                  d["metadata"]["name"]))
    return found


@dataclass
class Plan:
    """What this pass does to the worker Deployments."""

    phase: str
    revision: str  # the target
    new: dict[WorkerRole, int] = field(default_factory=dict)  # the new revision's, rolling
    old: dict[str, int] = field(default_factory=dict)  # an old Deployment's replicas, by name
    delete: list[str] = field(default_factory=list)  # old Deployments that are done
    probes: bool = False  # run the gate's probe pair
    step: tuple[int, int] = (0, 0)  # (i, K)
    message: str = ""

    @property
    def rolling(self) -> bool:
        return self.phase != STABLE


def steps(sizes: Mapping[WorkerRole, int], max_skew: int) -> int:
    """K: enough that one step moves at most `max_skew` percent of a pool, and no more than
    the larger pool has pods (a step that moves no pod in either pool is none)."""
    return max(1, min(math.ceil(100 / max_skew), max(sizes.values(), default=1)))


def new_at(step: int, size: int, k: int) -> int:
    """New-revision pods a pool of `size` wants at `step` of `k`."""
    return math.ceil(size * step / k)


def plan(svc: InferenceService, revision: str, live: Mapping[WorkerRole, list[Live]],
         sizes: Mapping[WorkerRole, int], gate: Gate | None) -> Plan:
    """The pass's decision (see the module doc). `sizes`: N per pool for a rollout; `gate`:
    the gate of `revision`, if one ran. Once only the new revision is left (Stable), its
    Deployments have the replicas the builders give them (or their autoscaler's)."""
    mine = {role: [d for d in live[role] if d.name == deployment_name(svc, role, revision)]
            for role in WORKER_ROLES}
    old = {role: [d for d in live[role] if d not in mine[role]] for role in WORKER_ROLES}
    if not any(old.values()):
        return Plan(STABLE, revision)
    # the old revision serves: each pool has a ready pod (else there is nothing to protect)
    serving = all(any(d.ready > 0 for d in old[role]) for role in WORKER_ROLES)
    # the revision serves already under another name (a Deployment of an older operator's,
    # `<name>-<role>`): nothing new to prove
    proven = any(d.revision == revision and d.ready > 0 for ds in old.values() for d in ds)
    started = any(mine.values())
    if serving and not started and not proven and svc.rollout.gate:
        if gate is not None and gate.revision == revision and gate.outcome == "failed":
            return Plan(PROBE_FAILED, revision, message=gate.message)
        if gate is None or gate.revision != revision or gate.outcome != "passed":
            why = gate.message if gate is not None and gate.revision == revision else ""
            return Plan(PROBING, revision, probes=True, message=why)
    k = steps(sizes, svc.rollout.max_skew)
    have = {role: sum(d.desired for d in mine[role]) for role in WORKER_ROLES}
    step = max(i for i in range(k + 1)
               if all(new_at(i, sizes[role], k) <= have[role] for role in WORKER_ROLES))
    ready = step > 0 and all(sum(d.ready for d in mine[role]) >= new_at(step, sizes[role], k)
                             for role in WORKER_ROLES)
    keep = {role: sizes[role] - new_at(step if ready else max(step - 1, 0), sizes[role], k)
            for role in WORKER_ROLES}
    result = Plan(ROLLING, revision, step=(step, k))
    for role in WORKER_ROLES:
        result.old.update(_share(old[role], keep[role]))
    old_done = all(d.desired <= result.old[d.name] and d.pods <= result.old[d.name]
                   for ds in old.values() for d in ds)
    if step == k and ready and old_done:  # the last step is done: only the new one serves
        result.delete = [d.name for ds in old.values() for d in ds]
        result.old = {}
        return dataclasses.replace(result, phase=STABLE)
    advance = step == 0 or (ready and old_done)
    target = min(step + 1, k) if advance else step
    result.new = {role: new_at(target, sizes[role], k) for role in WORKER_ROLES}
    result.step = (target, k)
    return result


def _share(old: list[Live], keep: int) -> dict[str, int]:
    """`keep` pods over one pool's old Deployments, the newest revision's first (each pool
    orders its revisions the same way, so a revision keeps prefills and decodes together)."""
    out = {}
    for d in reversed(old):
        out[d.name] = min(d.desired, keep)
        keep -= out[d.name]
    return out


def progress(svc: InferenceService, live: Mapping[WorkerRole, list[Live]], revision: str
             ) -> dict[WorkerRole, str]:
    """Per pool: ready pods of the new revision over its wanted ones, and the old pods left
    (`kubectl get bisvc` prints it)."""
    out = {}
    for role in WORKER_ROLES:
        new = [d for d in live[role] if d.name == deployment_name(svc, role, revision)]
        old = [d for d in live[role] if d not in new]
        text = f"{sum(d.ready for d in new)}/{sum(d.desired for d in new)} new"
        left = sum(max(d.pods, d.desired) for d in old)
        out[role] = f"{text}, {left} old" if left else text
    return out


def sizes(svc: InferenceService, live: Mapping[WorkerRole, list[Live]], revision: str,
          previous: Mapping[str, Any]) -> dict[WorkerRole, int]:
    """N per pool for a rollout: the spec's replicas, or the planner's; for a pool an
    autoscaler sizes, what its Deployments had when the rollout to `revision` began (the
    autoscaler is paused meanwhile), kept in status.rollout.replicas, within min and max."""
    out: dict[WorkerRole, int] = {}
    recorded = previous.get("replicas") if previous.get("revision") == revision else None
    for role in WORKER_ROLES:
        scale = svc.autoscaling.get(role)
        if svc.planner_scaled:
            out[role] = svc.planned_replicas(role)
        elif scale is None:
            out[role] = svc.pool(role).replicas
        else:
            kept = recorded.get(role) if isinstance(recorded, Mapping) else None
            had = kept if type(kept) is int else sum(d.desired for d in live[role])
            out[role] = min(max(had, scale.min), scale.max)
    return out


@dataclass
class Decision:
    """A pass's plan for the worker Deployments, and the gate it found."""

    plan: Plan
    gate: Gate | None
    replicas: dict[WorkerRole, int]

    def shape(self, svc: InferenceService, children: list[dict[str, Any]]
              ) -> list[dict[str, Any]]:
        """The pass's children under this plan: the new revision's Deployments at the step's
        replicas (left out while the gate has not passed), the probe pair while it runs, no
        autoscaler while anything but the new revision serves."""
        plan, out = self.plan, []
        targets = {deployment_name(svc, role, plan.revision): role for role in WORKER_ROLES}
        for child in children:
            kind, name = child["kind"], child["metadata"]["name"]
            if kind == "Deployment" and name in targets:
                if plan.phase in (PROBING, PROBE_FAILED):
                    continue
                if plan.phase == ROLLING:
                    child = {**child, "spec": {**child["spec"],
                                               "replicas": plan.new[targets[name]]}}
            elif kind in AUTOSCALERS and plan.rolling:
                continue
            out.append(child)
        if plan.probes:
            out += [build_probe_deployment(svc, role) for role in WORKER_ROLES]
        return out

    def status(self, svc: InferenceService, live: Mapping[WorkerRole, list[Live]]
               ) -> dict[str, Any]:
        """status.rollout: the phase, the target revision, each pool's progress, the gate's
        outcome and message, and the pool sizes a rollout holds."""
        plan, gate = self.plan, self.gate
        out: dict[str, Any] = {"revision": plan.revision, "phase": plan.phase}
        for role, text in progress(svc, live, plan.revision).items():
            out[role] = text
        if plan.rolling:
            out["replicas"] = dict(self.replicas)
        if plan.phase == ROLLING:
            out["step"] = f"{plan.step[0]}/{plan.step[1]}"
        if gate is not None and gate.revision == plan.revision:
            out.update(gate=gate.outcome, message=gate.message)
        elif plan.message:
            out["message"] = plan.message
        return out


AUTOSCALERS = ("HorizontalPodAutoscaler", "ScaledObject")


def decide(kube: Kube, svc: InferenceService, status: Mapping[str, Any]) -> Decision:
    """Read the worker Deployments, run the gate when its time has come, and plan."""
    revision = spec_revision(svc)
    live = {role: [Live.of(d) for d in ds]
            for role, ds in live_deployments(kube, svc).items()}
    found = status.get("rollout")
    previous: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    gate = None
    if previous.get("gate") in ("passed", "failed") and previous.get("revision") == revision:
        gate = Gate(revision, str(previous["gate"]), str(previous.get("message") or ""))
    n = sizes(svc, live, revision, previous)
    decision = plan(svc, revision, live, n, gate)
    if decision.phase == PROBING:
        gate = run_gate(kube, svc, revision)
        decision = plan(svc, revision, live, n, gate)
    return Decision(decision, gate, n)
