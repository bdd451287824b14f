"""Level-based status: recomputed from the children every time, never accumulated.

`compute_status()` is a pure function of the parsed service, the three Deployments we control
as the API returns them, the problems of the pass that just wrote the children (a name taken
by an object we do not control, a child the API server rejected, a pool whose pods refuse the
spec: refusal.py) and the previous status (only to keep `lastTransitionTime` of conditions
whose status did not change), so any number of event or timer passes converge on one answer:
nothing flaps while the cluster stands still.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from baton_operator.spec import ROLES, InferenceService, Role

# status.rollout.phase (rollout.py): one revision serves; the gate probes a new one; both
# serve while the pools step to it; the gate failed and the old one serves on
STABLE, PROBING, ROLLING, PROBE_FAILED = "Stable", "Probing", "RollingOut", "ProbeFailed"
# Ready=False reasons that need a person (Warning events); the others are progress (Normal).
PROBLEMS = ("InvalidSpec", "NameConflict", "ModelNotServable")


@dataclass(frozen=True)
class Problem:
    """Why the children cannot converge: reason is one of PROBLEMS; `role`: the one pool it
    is about (its own condition says so too)."""

    reason: str
    message: str
    role: Role | None = None


@dataclass(frozen=True)
class PoolState:
    """What one child Deployment says about its pool."""

    role: Role
    desired: int
    replicas: int = 0
    ready: int = 0
    updated: int = 0
    exists: bool = False
    current: bool = False  # the Deployment controller has seen its latest spec
    failure: str | None = None  # why the rollout is stuck, from the Deployment's conditions
    rolled_out: bool = False  # the Deployment controller saw its latest rollout complete

    @classmethod
    def from_deployment(cls, role: Role, deployment: Mapping[str, Any] | None,
                        fallback_desired: int) -> PoolState:
        if deployment is None:
            return cls(role=role, desired=fallback_desired)
        spec, status = deployment.get("spec") or {}, deployment.get("status") or {}
        generation = (deployment.get("metadata") or {}).get("generation", 0)
        return cls(
            role=role,
            desired=int(spec.get("replicas", fallback_desired)),
            replicas=int(status.get("replicas", 0)),
            ready=int(status.get("readyReplicas", 0)),
            updated=int(status.get("updatedReplicas", 0)),
            exists=True,
            current=int(status.get("observedGeneration", 0)) >= int(generation),
            failure=_failure(status.get("conditions") or []),
            rolled_out=_rolled_out(status.get("conditions") or []),
        )

    @property
    def settled(self) -> bool:
        """Rolled out: every pod runs the latest template and no old pod is left."""
        return (self.exists and self.current and self.updated >= self.desired
                and self.replicas <= self.updated)

    @property
    def available(self) -> bool:
        return self.settled and self.ready >= self.desired

    @property
    def lost_pods(self) -> bool:
        """Pods went unready after the rollout completed (a crash, an eviction): degraded,
        not still starting."""
        return self.settled and self.rolled_out and self.ready < self.desired

    @property
    def reason(self) -> str:
        if not self.exists or not self.settled:
            return "Updating"
        return "ReplicasReady" if self.available else "PodsNotReady"

    @property
    def counts(self) -> dict[str, int]:
        """Status of the pool; `desiredReplicas` is the live Deployment's (the HPA's choice
        when it autoscales), which `kubectl get` prints."""
        return {"replicas": self.replicas, "readyReplicas": self.ready,
                "updatedReplicas": self.updated, "desiredReplicas": self.desired}

    def describe(self) -> str:
        return f"{self.role} {self.ready}/{self.desired} ready"


def compute_status(svc: InferenceService, deployments: Mapping[str, Mapping[str, Any] | None],
                   previous: Mapping[str, Any], observed_generation: int,
                   problems: Sequence[Problem] = (), now: str | None = None,
                   extra: Sequence[Mapping[str, Any]] = (),
                   rollout: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The whole `status` of a valid service, from the Deployments it controls (a worker
    pool's revisions `merged`); `extra`: conditions decided elsewhere (Autoscaling), appended
    as they are; `rollout`: status.rollout (rollout.py), whose phase decides Progressing while
    a new revision is probed or rolled out."""
    pools = {role: PoolState.from_deployment(role, deployments.get(role), _fallback(svc, role))
             for role in ROLES}
    summary = ", ".join(pool.describe() for pool in pools.values())
    failures = [f"{p.role}: {p.failure}" for p in pools.values() if p.failure]
    lost = [p.describe() for p in pools.values() if p.lost_pods and not p.failure]
    ready, reason = _overall(pools)
    ready_condition = _condition("Ready", ready, reason, summary)
    progressing = _progressing(pools, failures, summary)
    if rollout is not None and rollout.get("phase") in ROLLOUT_REASONS and not failures:
        progressing = _rollout_condition(rollout)
    if problems:  # the children cannot converge: that, not the pools, is the answer
        message = "; ".join(p.message for p in problems)
        ready_condition = _condition("Ready", False, problems[0].reason, message)
        progressing = _condition("Progressing", False, problems[0].reason, message)
    fresh = [
        ready_condition,
        *(_pool_condition(pool, problems) for pool in pools.values()),
        progressing,
        _degraded(failures, lost),
        _disaggregation(svc, pools),
        *(dict(c) for c in extra),
    ]
    # the planner's last plan (planning.py writes it) goes with its targets
    gone = {"planner": None} if svc.planner is None and previous.get("planner") else {}
    return {
        **gone,
        "phase": _phase(pools, ready, bool(problems), bool(failures or lost)),
        "observedGeneration": observed_generation,
        "url": svc.url,
        **{role: {**pool.counts, **_ranks(svc, role)} for role, pool in pools.items()},
        **({"rollout": dict(rollout)} if rollout is not None else {}),
        "conditions": _stamp(fresh, previous, observed_generation, now),
    }


def merged(deployments: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """One pool's Deployments (one per revision, rollout.py) as one: replicas and pod counts
    summed, current when all are, every condition kept (one stuck revision is a failure)."""
    if not deployments:
        return None
    specs = [d.get("spec") or {} for d in deployments]
    statuses = [d.get("status") or {} for d in deployments]
    current = all(int(st.get("observedGeneration", 0)) >= int(d["metadata"].get("generation", 0))
                  for d, st in zip(deployments, statuses, strict=True))
    return {
        "metadata": {"generation": 1},
        "spec": {"replicas": sum(int(sp.get("replicas", 1)) for sp in specs)},
        "status": {"observedGeneration": int(current),
                   **{key: sum(int(st.get(key, 0)) for st in statuses)
                      for key in ("replicas", "readyReplicas", "updatedReplicas")},
                   "conditions": [c for st in statuses for c in st.get("conditions") or []]},
    }


# status.rollout.phase (rollout.py) -> the Progressing condition while it lasts
ROLLOUT_REASONS = {PROBING: True, ROLLING: True, PROBE_FAILED: False}


def _rollout_condition(rollout: Mapping[str, Any]) -> dict[str, Any]:
    phase = str(rollout["phase"])
    pools = f"prefill {rollout.get('prefill', '')}, decode {rollout.get('decode', '')}"
    if phase == PROBE_FAILED:
        message = (f"revision {rollout.get('revision')} failed the gate, the old revision "
                   f"keeps serving: {rollout.get('message', '')}")
    elif phase == PROBING:
        message = (f"probing revision {rollout.get('revision')} before it serves: "
                   f"{rollout.get('message') or 'starting the probe pods'}")
    else:
        message = (f"revision {rollout.get('revision')}, step {rollout.get('step', '')}: "
                   f"{pools}")
    return _condition("Progressing", ROLLOUT_REASONS[phase], phase, message)


def invalid_status(message: str, generation: int, previous: Mapping[str, Any],
                   now: str | None = None) -> dict[str, Any]:
    """Status of a spec that can never work: Ready=False/InvalidSpec, nothing else touched."""
    fresh = [_condition("Ready", False, "InvalidSpec", message),
             _condition("Progressing", False, "InvalidSpec", "fix the spec to continue")]
    kept = [c for c in previous.get("conditions") or []
            if c.get("type") not in ("Ready", "Progressing")]
    status = {k: v for k, v in previous.items() if k != "kopf"}
    status.update(phase="Failed", observedGeneration=generation,
                  conditions=_stamp(fresh, previous, generation, now) + kept)
    return status


def same_status(new: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
    """Whether writing `new` would change anything we own in `old`."""
    return all(old.get(key) == value for key, value in new.items())


def ready_event(old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(type, reason, message) of the Event to post when a status write changes readiness:
    when Ready flips, or its reason enters or leaves a problem. Becoming Ready, progress
    (Updating, PodsNotReady while starting) and leaving a problem are Normal; a problem, or
    pods going unready in a service that was Ready, is a Warning."""
    before, after = condition(old, "Ready"), condition(new, "Ready")
    if (before.get("status"), before.get("reason")) == (after.get("status"), after.get("reason")):
        return None
    flipped = before.get("status") != after.get("status")
    problem = after.get("reason") in PROBLEMS
    if not (flipped or problem or before.get("reason") in PROBLEMS):
        return None
    message = str(after.get("message", ""))
    if after.get("status") == "True":
        return "Normal", "Ready", message
    regressed = after.get("reason") == "PodsNotReady" and before.get("status") == "True"
    return ("Warning" if problem or regressed else "Normal"), str(after.get("reason")), message


def rollout_event(old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(type, reason, message) of the Event to post when a rollout's gate decides (a Warning
    when it failed) or when a rolled-out revision is left alone serving."""
    before, after = old.get("rollout") or {}, new.get("rollout") or {}
    revision = after.get("revision")
    if after.get("gate") in ("passed", "failed") and (
            (before.get("revision"), before.get("gate")) != (revision, after.get("gate"))):
        if after["gate"] == "failed":
            return "Warning", "ProbeFailed", (f"revision {revision} failed the gate, the old "
                                              f"revision keeps serving: {after.get('message')}")
        return "Normal", "ProbePassed", f"revision {revision}: {after.get('message')}"
    if before.get("phase") == ROLLING and after.get("phase") == STABLE:
        return "Normal", "RolledOut", f"revision {revision} serves alone"
    return None


def condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    for cond in status.get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return {}


def _overall(pools: Mapping[Role, PoolState]) -> tuple[bool, str]:
    if not all(pool.settled for pool in pools.values()):
        return False, "Updating"
    if not all(pool.available for pool in pools.values()):
        return False, "PodsNotReady"
    if not all(pool.ready > 0 for pool in pools.values()):
        return False, "ScaledToZero"
    return True, "AllPoolsReady"


def _pool_condition(pool: PoolState, problems: Sequence[Problem]) -> dict[str, Any]:
    kind = f"{pool.role.capitalize()}Ready"
    mine = next((p for p in problems if p.role == pool.role), None)
    if mine is not None:
        return _condition(kind, False, mine.reason, mine.message)
    return _condition(kind, pool.available, pool.reason, pool.describe())


def _phase(pools: Mapping[Role, PoolState], ready: bool, blocked: bool, failed: bool) -> str:
    if blocked:
        return "Failed"
    if ready:
        return "Ready"
    if failed:
        return "Degraded"
    return "Progressing" if any(pool.ready for pool in pools.values()) else "Pending"


def _progressing(pools: Mapping[Role, PoolState], failures: list[str], summary: str
                 ) -> dict[str, Any]:
    if failures:
        return _condition("Progressing", False, "ProgressDeadlineExceeded", "; ".join(failures))
    if all(pool.available for pool in pools.values()):
        return _condition("Progressing", False, "Complete", summary)
    return _condition("Progressing", True, "RollingOut", summary)


def _degraded(failures: list[str], lost: list[str]) -> dict[str, Any]:
    if failures:
        return _condition("Degraded", True, "RolloutFailed", "; ".join(failures))
    if lost:
        return _condition("Degraded", True, "PodsLost",
                          "; ".join(lost) + " after the rollout completed")
    return _condition("Degraded", False, "AsExpected", "no pool reports a failed rollout")


def _disaggregation(svc: InferenceService, pools: Mapping[Role, PoolState]) -> dict[str, Any]:
    """DisaggregationDegraded: True while requests cannot be disaggregated (no prefill pod is
    ready while decodes are): with `spec.router.fallback: colocated` the decodes then prefill
    locally (the router counts it in baton_router_pd_fallback_total), with `fail` the router
    refuses them (503). A PD service never degrades silently."""
    prefill, decode = pools["prefill"], pools["decode"]
    if prefill.ready > 0 or decode.ready == 0:
        return _condition("DisaggregationDegraded", False, "Disaggregated",
                          f"{prefill.ready} prefill pod(s) ready")
    if svc.router.fallback == "colocated":
        return _condition("DisaggregationDegraded", True, "DecodesPrefillLocally",
                          "no prefill pod is ready: the decodes prefill requests themselves")
    return _condition("DisaggregationDegraded", True, "NoPrefill",
                      "no prefill pod is ready: the router refuses requests (503); "
                      "spec.router.fallback: colocated would serve them from the decodes")


def _rolled_out(conditions: list[Mapping[str, Any]]) -> bool:
    """The Deployment controller's mark of a completed rollout (kept while pods come and go,
    until the next rollout starts)."""
    return any(c.get("type") == "Progressing" and c.get("status") == "True"
               and c.get("reason") == "NewReplicaSetAvailable" for c in conditions)


def _failure(conditions: list[Mapping[str, Any]]) -> str | None:
    for cond in conditions:
        stuck = cond.get("type") == "Progressing" and cond.get("status") == "False"
        failed = cond.get("type") == "ReplicaFailure" and cond.get("status") == "True"
        if stuck or failed:
            return f"{cond.get('reason', cond.get('type'))}: {cond.get('message', '')}".strip()
    return None


def _ranks(svc: InferenceService, role: Role) -> dict[str, int]:
    """A worker pool's ranks per pod (`kubectl get bisvc -o wide` shows them)."""
    if role == "router":
        return {}
    return {"tensorParallelSize": svc.pool(role).tensor_parallel_size}


def _fallback(svc: InferenceService, role: Role) -> int:
    if role != "router" and svc.planner_scaled:
        return svc.planned_replicas(role)
    scale = svc.autoscaling.get(role)
    return scale.min if scale is not None else svc.replicas(role)


def _condition(kind: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": kind, "status": "True" if ok else "False", "reason": reason,
            "message": message}


def _stamp(fresh: list[dict[str, Any]], previous: Mapping[str, Any], generation: int,
           now: str | None) -> list[dict[str, Any]]:
    """Add observedGeneration and lastTransitionTime (kept while the status is unchanged)."""
    stamp = now or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    out = []
    for cond in fresh:
        old = condition(previous, cond["type"])
        since = old.get("lastTransitionTime") if old.get("status") == cond["status"] else None
        out.append({**cond, "lastTransitionTime": since or stamp, "observedGeneration": generation})
    return out
