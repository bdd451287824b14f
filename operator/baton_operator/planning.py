"""The P:D planner at work in the operator (its queueing model: planner.py).

Every `plan_seconds` (BATON_OPERATOR_PLAN_SECONDS), for each service with planner targets
(spec.autoscaling.ttftTarget and itlTarget):
1. read the live figures from a ready router pod, `GET http://<pod IP>:8000/debug/planner`:
   the router sums its workers' counters over a window (runtime/router/figures.py);
2. plan both pools with the model, each within its min and max;
3. with `mode: planner`, step toward the plan (`step`): a pool changes at most once per
   cooldown; it goes up to the plan as soon as the plan is above it, and down only when every
   plan since its last change, over a whole cooldown, was below it (to the highest of them).
   A load that sits between two counts therefore settles on the higher one instead of flapping;
4. publish it: `status.planner` (RECOMMENDED in `kubectl get bisvc -o wide`), the operator's
   `baton_recommended_replicas{namespace,name,role}`, and the whole explanation, figures
   included, at the operator's `GET /debug/planner` (metrics.py).
The pass (reconcile.py) renders the enacted replicas into the Deployments; nothing here writes
a Deployment.

Without figures (no router ready, no traffic measured yet) the replicas stay as they are and
status.planner.message says why. With no requests at all in the router's window, both pools
are planned at their min.
"""

from __future__ import annotations

import datetime
import json
import math
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from baton_operator.builders.common import HTTP_PORT, LABEL_INSTANCE, LABEL_ROLE
from baton_operator.kube import Kube
from baton_operator.planner import RolePlan, Targets, figures_from, plan
from baton_operator.spec import WORKER_ROLES, InferenceService, WorkerRole

FIGURES_PATH = "/debug/planner"
FETCH_TIMEOUT_S = 5.0
Clock = Callable[[], float]


@dataclass(frozen=True)
class Figures:
    """What a router measured (its /debug/planner JSON), or why there is nothing."""

    doc: Mapping[str, Any] | None
    source: str  # the URL read, or what was missing
    error: str | None = None


def ready_routers(kube: Kube, svc: InferenceService) -> list[str]:
    """`http://<pod IP>:8000` of every ready router pod of the service."""
    pods = kube.select("v1", "Pod", svc.namespace, {LABEL_INSTANCE: svc.name,
                                                     LABEL_ROLE: "router"})
    return [f"http://{_host(p['status']['podIP'])}:{HTTP_PORT}" for p in pods
            if pod_ready(p) and (p.get("status") or {}).get("podIP")]


def router_figures(kube: Kube, svc: InferenceService, timeout: float = FETCH_TIMEOUT_S
                   ) -> Figures:
    """The figures of the first ready router pod that answers."""
    routers = ready_routers(kube, svc)
    if not routers:
        return Figures(None, "", "no router pod is ready")
    errors = []
    for router in routers:
        url = f"{router}{FIGURES_PATH}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                doc = json.loads(response.read())
            if isinstance(doc, dict):
                return Figures(doc, url)
            errors.append(f"{url}: not a JSON object")
        except urllib.error.HTTPError as e:
            errors.append(f"{url}: HTTP {e.code} (with API keys and --protect-metrics on, the "
                          "router refuses it)" if e.code in (401, 403) else f"{url}: HTTP {e.code}")
        except (OSError, ValueError) as e:
            errors.append(f"{url}: {type(e).__name__}: {e}")
    return Figures(None, "", "; ".join(errors))


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """The pod's Ready condition is True."""
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


@dataclass
class History:
    """One pool's recent plans (monotonic time, replicas): what a scale-down waits on."""

    plans: deque[tuple[float, int]] = field(default_factory=deque)
    changed: float | None = None  # when the planner last changed the pool (monotonic)

    def add(self, now: float, replicas: int, keep_s: float) -> None:
        self.plans.append((now, replicas))
        while self.plans and self.plans[0][0] < now - keep_s:
            self.plans.popleft()


def step(current: int, recommended: int, history: History, now: float, cooldown_s: float
         ) -> tuple[int, str]:
    """The replicas to enact now, and why (see the module doc); `history` already holds the
    plan just made."""
    if recommended == current:
        return current, "at the plan"
    if history.changed is not None and now - history.changed < cooldown_s:
        wait = cooldown_s - (now - history.changed)
        return current, f"cooling down ({wait:.0f} s to go) before changing from {current}"
    if recommended > current:
        return recommended, f"up from {current}"
    since = max(now - cooldown_s, history.changed if history.changed is not None else -math.inf)
    recent = [n for t, n in history.plans if t >= since]
    covered = bool(history.plans) and history.plans[0][0] <= now - cooldown_s
    highest = max(recent, default=current)
    if not covered or highest >= current:
        return current, (f"holding {current}: a plan below it has to last {cooldown_s:.0f} s "
                         "before the pool shrinks")
    return highest, f"down from {current} (every plan for {cooldown_s:.0f} s was <= {highest})"


@dataclass
class Decision:
    """One service's plan, as published."""

    recommended: dict[str, int]  # role -> the model's replicas (none without figures)
    replicas: dict[str, int]  # mode planner: role -> what the pool runs from now on
    status: dict[str, Any]  # status.planner


class Planning:
    """The planner's memory across passes (recent plans per pool) and its last explanations."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.histories: dict[tuple[str, str, str], History] = {}
        self.explained: dict[str, dict[str, Any]] = {}  # "namespace/name" -> explanation

    def decide(self, svc: InferenceService, figures: Figures) -> Decision:
        assert svc.planner is not None
        targets = Targets(svc.planner.ttft_ms / 1000, svc.planner.itl_ms / 1000,
                          _bounds(svc, "prefill"), _bounds(svc, "decode"))
        now = self.clock()
        plans, problem = _plan(figures, targets)
        status: dict[str, Any] = {"mode": "planner" if svc.planner_scaled else "recommend"}
        replicas: dict[str, int] = {}
        recommended: dict[str, int] = {}
        for role in WORKER_ROLES:
            entry: dict[str, Any] = {}
            role_plan = plans.get(role)
            if role_plan is not None:
                recommended[role] = role_plan.replicas
                entry.update(recommended=role_plan.replicas, met=role_plan.met, why=role_plan.why)
            if svc.planner_scaled:  # mode planner: what the pool runs, stepped toward the plan
                current = svc.planned_replicas(role)
                replicas[role], entry["action"] = (
                    (current, "no plan") if role_plan is None else
                    self._step(svc, role, current, role_plan.replicas, now))
                entry["replicas"] = replicas[role]
            status[role] = entry
        if recommended:
            status["recommended"] = f"{recommended['prefill']}:{recommended['decode']}"
        if problem:
            status["message"] = problem
        explanation = {"service": f"{svc.namespace}/{svc.name}", "source": figures.source,
                       "figures": dict(figures.doc or {}), "targets": asdict(targets),
                       "plans": {r: asdict(p) for r, p in plans.items()}, "status": status,
                       "at": _utc_now()}
        self.explained[f"{svc.namespace}/{svc.name}"] = explanation
        return Decision(recommended, replicas, status)

    def forget(self, namespace: str, name: str) -> None:
        self.explained.pop(f"{namespace}/{name}", None)
        for key in [k for k in self.histories if k[:2] == (namespace, name)]:
            del self.histories[key]

    def _step(self, svc: InferenceService, role: WorkerRole, current: int, recommended: int,
              now: float) -> tuple[int, str]:
        assert svc.planner is not None
        cooldown = float(svc.planner.cooldown_s)
        history = self.histories.setdefault((svc.namespace, svc.name, role), History())
        history.add(now, recommended, keep_s=max(cooldown, 1.0) * 2)
        enacted, why = step(current, recommended, history, now, cooldown)
        if enacted != current:
            history.changed = now
        return enacted, why


def _plan(figures: Figures, targets: Targets) -> tuple[dict[str, RolePlan], str | None]:
    """Both roles' plans, or none and why."""
    if figures.doc is None:
        return {}, f"no figures: {figures.error}; the pools stay as they are"
    doc = figures.doc
    if doc.get("rate") == 0:  # the router saw no request in its window: the pools' min
        idle = {"prefill": targets.prefill[0], "decode": targets.decode[0]}
        why = f"no requests in the last {doc.get('window_s', '?')} s"
        return {role: RolePlan(role, n, 0.0, 0.0, True, why) for role, n in idle.items()}, None
    missing = [key for key in ("rate", "prompt_tokens", "output_tokens", "prefill_tokens_per_s",
                               "decode_steps") if doc.get(key) in (None, [])]
    if missing:
        said = "; ".join(str(m) for m in doc.get("missing") or [])
        return {}, (f"the router has no {', '.join(missing)} yet" + (f" ({said})" if said else "")
                    + "; the pools stay as they are")
    try:
        load, measured, _ = figures_from({**doc, "ttft_target_s": targets.ttft_s,
                                          "itl_target_s": targets.itl_s})
        return dict(plan(load, measured, targets)), None
    except ValueError as e:
        return {}, f"cannot plan from {figures.source}: {e}"


def _bounds(svc: InferenceService, role: WorkerRole) -> tuple[int, int]:
    """What the planner may recommend: the pool's autoscaling min and max; a pool without
    them is planned between 1 and 64 (a recommendation only)."""
    return svc.bounds(role) if role in svc.autoscaling else (1, 64)


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
