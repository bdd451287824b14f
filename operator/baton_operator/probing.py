"""The rollout gate: a new revision serves only after a pair of it computed exact tokens.

While a rollout is in its Probing phase (rollout.py), the pass renders one probe pod per
worker pool from the new revision's templates with the token oracle and the KV canary on
(builders/workloads.py `build_probe_deployment`; the router's discovery and the Services never
select them). Once both are ready, the operator asks a ready router pod for
`POST /debug/probe` through that pair (runtime/router/probe.py): probe requests of a few prompt
lengths, each answered with exactly the oracle's tokens for its room and no KV canary
violation on either pod, or the gate fails and names the first probe that did not. The operator
authenticates with the token it derives from the service's cluster key
(builders/cluster_key.py `operator_token`), which the router accepts as an admin credential.

The outcome goes to status.rollout (`passed`, `failed` or `pending`, with the message):
- passed: the new revision's Deployments start (the rollout's steps);
- failed: the rollout stops, the old revision keeps serving, Progressing=False with reason
  ProbeFailed and the verdict's first failure as the message. A probe pod that refuses the
  revision (exit code 2, refusal.py) or that is not ready within
  `spec.rollout.probeTimeoutSeconds` fails it too. Only a new revision (a spec change) is
  probed again;
- pending: the pair is not ready yet, or the router could not be asked (no router ready, a
  network error): asked again on the next pass.
"""

from __future__ import annotations

import base64
import datetime
import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from baton_operator.builders.cluster_key import FILE, cluster_key_name, operator_token
from baton_operator.builders.common import (
    BOOTSTRAP_PORT,
    HTTP_PORT,
    LABEL_INSTANCE,
    LABEL_NAME,
    LABEL_REVISION,
    LABEL_ROLE,
    PROBING,
    probe_name,
)
from baton_operator.builders.workloads import build_probe_deployment
from baton_operator.kube import Kube
from baton_operator.planning import pod_ready, ready_routers
from baton_operator.refusal import main_container, refused_message
from baton_operator.spec import WORKER_ROLES, InferenceService, WorkerRole

PROBE_PATH = "/debug/probe"
PROMPT_TOKENS = (5, 40, 300)  # a short, a middling and a long prompt: several KV pages
MAX_TOKENS = 8
PROBE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Gate:
    """Where the gate of `revision` stands (status.rollout): passed | failed | pending, and
    why."""

    revision: str
    outcome: str
    message: str = ""


def run_gate(kube: Kube, svc: InferenceService, revision: str,
             now: datetime.datetime | None = None) -> Gate:
    """Where the gate of `revision` stands now; asks the router once both probe pods are ready."""
    pods: dict[WorkerRole, Mapping[str, Any] | None] = {}
    for role in WORKER_ROLES:
        found = kube.select("v1", "Pod", svc.namespace, {
            LABEL_NAME: PROBING, LABEL_INSTANCE: svc.name, LABEL_ROLE: role,
            LABEL_REVISION: revision})
        refused = _refusal(svc, role, found)
        if refused is not None:
            return Gate(revision, "failed", f"the {role} probe pod refuses revision {revision}: "
                                            f"{refused}")
        live = [p for p in found if not (p.get("metadata") or {}).get("deletionTimestamp")]
        pods[role] = next((p for p in live if pod_ready(p) and _ip(p)), None)
    waiting = [role for role, pod in pods.items() if pod is None]
    if waiting:
        age = _age(kube, svc, now)
        if age is not None and age > svc.rollout.probe_timeout_s:
            return Gate(revision, "failed", f"the probe pods of revision {revision} were not "
                        f"ready within {svc.rollout.probe_timeout_s} s "
                        f"(spec.rollout.probeTimeoutSeconds): {' and '.join(waiting)} not ready")
        return Gate(revision, "pending", f"waiting for the {' and '.join(waiting)} probe pod(s) "
                                         f"of revision {revision}")
    prefill, decode = pods["prefill"], pods["decode"]
    assert prefill is not None and decode is not None
    body = {"prefill": f"http://{_ip(prefill)}:{HTTP_PORT}", "bootstrap_port": BOOTSTRAP_PORT,
            "decode": f"http://{_ip(decode)}:{HTTP_PORT}",
            "prompt_tokens": list(PROMPT_TOKENS), "max_tokens": MAX_TOKENS}
    return ask_router(kube, svc, revision, body)


def ask_router(kube: Kube, svc: InferenceService, revision: str, body: Mapping[str, Any],
               timeout: float = PROBE_TIMEOUT_S) -> Gate:
    """POST the probes to the first ready router pod that answers: its verdict, or pending."""
    token = _token(kube, svc)
    if token is None:
        return Gate(revision, "pending", f"the cluster key Secret {cluster_key_name(svc)} is "
                                         "missing or empty")
    routers = ready_routers(kube, svc)
    if not routers:
        return Gate(revision, "pending", "no router pod is ready to run the probes")
    errors = []
    for url in routers:
        request = urllib.request.Request(
            f"{url}{PROBE_PATH}", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                verdict = json.loads(response.read())
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")[:1000]
            if e.code == 409:  # the pair cannot prove anything: the revision is not servable
                return Gate(revision, "failed", f"the probe pair of revision {revision} cannot "
                                                f"be probed: {_message(text)}")
            errors.append(f"{url}: HTTP {e.code}: {_message(text)}")
            continue
        except (OSError, ValueError) as e:
            errors.append(f"{url}: {type(e).__name__}: {e}")
            continue
        if not isinstance(verdict, dict):
            errors.append(f"{url}: the verdict is not a JSON object")
            continue
        if verdict.get("passed") is True:
            return Gate(revision, "passed", f"{len(verdict.get('probes') or [])} probes of "
                                            f"revision {revision} exact")
        return Gate(revision, "failed", str(verdict.get("failed") or verdict))
    return Gate(revision, "pending", "the router could not run the probes: " + "; ".join(errors))


def _token(kube: Kube, svc: InferenceService) -> str | None:
    """The admin credential the router derives from the service's cluster key."""
    secret = kube.get("v1", "Secret", svc.namespace, cluster_key_name(svc))
    data = ((secret or {}).get("data") or {}).get(FILE)
    if not data:
        return None
    return operator_token(base64.b64decode(data).strip())


def _refusal(svc: InferenceService, role: WorkerRole,
             pods: Sequence[Mapping[str, Any]]) -> str | None:
    container = main_container(build_probe_deployment(svc, role))
    return next((m for pod in pods if (m := refused_message(pod, container))), None)


def _age(kube: Kube, svc: InferenceService, now: datetime.datetime | None) -> float | None:
    """Seconds since the older probe Deployment was made (None: none yet)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    made = []
    for role in WORKER_ROLES:
        d = kube.get("apps/v1", "Deployment", svc.namespace, probe_name(svc, role))
        stamp = ((d or {}).get("metadata") or {}).get("creationTimestamp")
        if stamp:
            made.append(datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")))
    return (now - min(made)).total_seconds() if made else None


def _ip(pod: Mapping[str, Any]) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    return None if not ip else f"[{ip}]" if ":" in ip else str(ip)


def _message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text
