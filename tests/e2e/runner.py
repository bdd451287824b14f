"""The pod runner: kubelet and the Deployment controller of the local cluster, in one loop.

Every `tick` it reads all Deployments and Pods through the API and, level-based:
- keeps `spec.replicas` Pods of each Deployment's current template (labels from the template
  plus `pod-template-hash`, a controller owner reference to the Deployment, no ReplicaSet in
  between); on a template change the new Pods come first and the old ones go once the new are
  ready; scaling down removes not-ready Pods first, then the newest, as a ReplicaSet does;
- runs each Pod (tests/e2e/pod.py), restarts a container that exited, probes readiness every
  `probe_period` (kubelet would use the probe's periodSeconds; a test cluster wants speed),
  and writes the Pod's status (podIP, Ready, restartCount) when it changes;
- ends the process of a Pod that was deleted (by us, `kubectl delete pod`, or the garbage
  collector after its Deployment went): SIGTERM, SIGKILL after the grace period;
- writes each Deployment's status as the controller does: observedGeneration, replicas,
  updatedReplicas, readyReplicas, availableReplicas, and the Available and Progressing
  conditions (Progressing reason NewReplicaSetAvailable once a rollout completed, kept while
  pods come and go until the next rollout).
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.pod import Pod

log = logging.getLogger("local-cluster.runner")
MERGE = {"Content-Type": "application/merge-patch+json"}
Key = tuple[str, str]  # (namespace, name)


class PodRunner:
    def __init__(self, api_url: str, root: Path, tick: float = 0.2, probe_period: float = 0.5,
                 grace_cap: float | None = None) -> None:
        self.api_url, self.root = api_url, root
        self.tick, self.probe_period, self.grace_cap = tick, probe_period, grace_cap
        self.api = httpx.Client(base_url=api_url, headers={"Authorization": "Bearer runner"},
                                timeout=10, trust_env=False)
        self.probes = httpx.Client(trust_env=False)
        self.pods: dict[Key, Pod] = {}
        self.dying: list[Pod] = []
        self.rollouts: dict[str, tuple[int, bool]] = {}  # Deployment uid -> (generation, done)
        self.written: dict[tuple[str, Key], Any] = {}  # last status written, by (kind, key)
        self._addresses = (f"127.0.0.{n}" for n in range(2, 255))
        self._stop = threading.Event()
        self._last_probe = 0.0
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name="pod-runner", daemon=True)

    # -- the loop ------------------------------------------------------------------------

    def start(self) -> PodRunner:
        self.thread.start()
        return self

    def stop(self, timeout: float = 30) -> None:
        """Stop the loop and every pod (SIGTERM, SIGKILL after at most 10 s)."""
        self._stop.set()
        self.thread.join(timeout)
        self.api.close()
        self.probes.close()

    def _loop(self) -> None:
        # NOTE: the pods' processes get SIGKILL when this thread ends (their parent-death
        # signal follows the thread that started them), so it ends them itself first.
        while not self._stop.is_set():
            try:
                with self._lock:
                    self.sync()
            except (httpx.HTTPError, KeyError, ValueError) as e:
                log.warning("pod runner: %s: %s", type(e).__name__, e)
            self._stop.wait(self.tick)
        with self._lock:
            self._end_all()

    def _end_all(self) -> None:
        everyone = [*self.pods.values(), *self.dying]
        for pod in everyone:
            pod.terminate(grace_cap=10.0)
        deadline = time.monotonic() + 12
        while not all([pod.reap() for pod in everyone]) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pod in everyone:
            pod.reap(force=True)
        self.pods.clear()
        self.dying.clear()

    def sync(self) -> None:
        deployments = {(d["metadata"]["namespace"], d["metadata"]["name"]): d
                       for d in self._list("/apis/apps/v1/deployments")}
        live_pods = {(p["metadata"]["namespace"], p["metadata"]["name"])
                     for p in self._list("/api/v1/pods")}
        for key in [k for k in self.pods if k not in live_pods]:  # deleted by someone
            self._forget(key)
        probe = time.monotonic() - self._last_probe >= self.probe_period
        if probe:
            self._last_probe = time.monotonic()
        for pod in list(self.pods.values()):
            self._keep_running(pod, probe)
        for (namespace, name), deployment in deployments.items():
            self._reconcile(namespace, name, deployment)
        for pod in [p for p in self.pods.values() if (p.namespace, p.owner) not in deployments]:
            self._delete(pod)  # its Deployment is gone (the garbage collector does this too)
        self.dying = [pod for pod in self.dying if not pod.reap()]

    # -- kubelet -------------------------------------------------------------------------

    def _keep_running(self, pod: Pod, probe: bool) -> None:
        if pod.refused:
            pass
        elif pod.proc is None:
            pod.start()
        elif not pod.running():
            log.info("pod %s/%s: container exited (%s), restarting", pod.namespace, pod.name,
                     pod.proc.returncode)
            pod.kill_group()
            pod.restarts += 1
            pod.start()
        if probe:
            pod.probe(self.probes)
        self._write_status("pods", pod.namespace, pod.name, pod.status())

    # -- the Deployment controller -------------------------------------------------------

    def _reconcile(self, namespace: str, name: str, deployment: Mapping[str, Any]) -> None:
        spec = deployment["spec"]
        desired = int(spec.get("replicas", 1))
        template_hash = _hash(spec["template"])
        mine = [p for p in self.pods.values() if (p.namespace, p.owner) == (namespace, name)]
        current = [p for p in mine if p.template_hash == template_hash]
        old = [p for p in mine if p.template_hash != template_hash]
        for _ in range(desired - len(current)):
            current.append(self._create(namespace, name, deployment, template_hash))
        surplus = sorted(current, key=lambda p: (p.ready, -p.created))[:max(0, len(current) - desired)]
        for pod in surplus:
            self._delete(pod)
            current.remove(pod)
        if old and sum(p.ready for p in current) >= desired:
            for pod in old:
                self._delete(pod)
            old = []
        self._deployment_status(namespace, name, deployment, current, old, desired)

    def _deployment_status(self, namespace: str, name: str, deployment: Mapping[str, Any],
                           current: list[Pod], old: list[Pod], desired: int) -> None:
        meta = deployment["metadata"]
        generation = int(meta.get("generation", 1))
        ready = sum(p.ready for p in current) + sum(p.ready for p in old)
        updated, replicas = len(current), len(current) + len(old)
        seen, done = self.rollouts.get(meta["uid"], (0, False))
        if generation != seen:
            done = False
        complete = updated == desired and replicas == desired and ready >= desired
        done = done or complete
        self.rollouts[meta["uid"]] = (generation, done)
        progressing = ("NewReplicaSetAvailable", f"Deployment {name} has successfully progressed"
                       ) if done else ("ReplicaSetUpdated", f"Deployment {name} is progressing")
        available = ready >= desired
        status = {
            "observedGeneration": generation, "replicas": replicas, "updatedReplicas": updated,
            "readyReplicas": ready, "availableReplicas": ready,
            "unavailableReplicas": max(0, replicas - ready),
            "conditions": [
                {"type": "Available", "status": "True" if available else "False",
                 "reason": "MinimumReplicasAvailable" if available
                 else "MinimumReplicasUnavailable"},
                {"type": "Progressing", "status": "True", "reason": progressing[0],
                 "message": progressing[1]},
            ],
        }
        self._write_status("deployments", namespace, name, status, group="/apis/apps/v1")

    def _create(self, namespace: str, owner: str, deployment: Mapping[str, Any],
                template_hash: str) -> Pod:
        template = deployment["spec"]["template"]
        name = f"{owner}-{template_hash}-{secrets.token_hex(3)[:5]}"
        meta = template.get("metadata") or {}
        body = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": name, "namespace": namespace,
                "labels": {**(meta.get("labels") or {}), "pod-template-hash": template_hash},
                "annotations": dict(meta.get("annotations") or {}),
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": owner, "uid": deployment["metadata"]["uid"],
                                     "controller": True, "blockOwnerDeletion": True}]},
            "spec": {**template["spec"], "nodeName": "local"},
        }
        self.api.post(f"/api/v1/namespaces/{namespace}/pods", json=body).raise_for_status()
        pod = Pod(namespace, name, owner, template_hash, self._address(), body["spec"],
                  self.api_url, self.root / namespace / name)
        self.pods[namespace, name] = pod
        log.info("pod %s/%s on %s", namespace, name, pod.ip)
        return pod

    def _delete(self, pod: Pod) -> None:
        """Delete the Pod object (it leaves its Services at once) and end its process."""
        self.api.delete(f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}")
        self._forget((pod.namespace, pod.name))

    def _forget(self, key: Key) -> None:
        pod = self.pods.pop(key)
        pod.terminate(self.grace_cap)
        self.dying.append(pod)
        self.written.pop(("pods", key), None)

    # -- helpers -------------------------------------------------------------------------

    def _address(self) -> str:
        taken = {p.ip for p in [*self.pods.values(), *self.dying]}
        for ip in self._addresses:
            if ip not in taken:
                return ip
        raise RuntimeError("the local cluster ran out of 127.0.0.x pod addresses")

    def _list(self, path: str) -> list[dict[str, Any]]:
        response = self.api.get(path)
        response.raise_for_status()
        return list(response.json().get("items") or [])

    def _write_status(self, plural: str, namespace: str, name: str, status: dict[str, Any],
                      group: str = "/api/v1") -> None:
        key = (plural, (namespace, name))
        if self.written.get(key) == status:
            return
        response = self.api.patch(f"{group}/namespaces/{namespace}/{plural}/{name}/status",
                                  content=json.dumps({"status": status}), headers=MERGE)
        if response.status_code == 404:
            return
        response.raise_for_status()
        self.written[key] = status

    def processes(self) -> list[tuple[Pod, int]]:
        """(pod, main pid) of every pod with a process, the dying included."""
        with self._lock:
            return [(pod, pod.proc.pid) for pod in [*self.pods.values(), *self.dying]
                    if pod.proc is not None]

    def pod(self, namespace: str, name: str) -> Pod:
        return self.pods[namespace, name]


def _hash(template: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
