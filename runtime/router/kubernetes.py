"""Workers found through the Kubernetes API: `baton router --discovery kubernetes`.

Each role is a label selector over the Pods of one namespace. The router lists them, then
watches from the list's resourceVersion; when the watch ends or fails it lists again (after
`retry_s` on an error), so it never acts on a stale view for long. A pod is a worker while it is
Ready, has a `status.podIP` and is not being deleted: `http://<podIP>:<its container port named
"http">`, and a prefill's bootstrap port is its container port named "bootstrap". Nothing about
ports is configured here: the pod spec says it.

Credentials: the pod's service account (in-cluster config) when the router runs in a pod, else
the kubeconfig (`$KUBECONFIG`, `~/.kube/config`). The router needs only get/list/watch on Pods
in its namespace (the operator grants exactly that to the router's ServiceAccount).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from runtime.router.config import DEFAULT_BOOTSTRAP_PORT, ROLES, Role, WorkerAddress
from runtime.router.discovery import Discovery, address_url

log = logging.getLogger("baton.router")
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
WATCH_TIMEOUT_S = 300  # the API server ends a watch after this; we list and watch again


class KubeApi:
    """Where the API is and how to authenticate, from the `kubernetes` package's loaders;
    requests go through one httpx client (async, like the rest of the router)."""

    def __init__(self) -> None:
        import kubernetes  # only this discovery mode needs it

        config = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)
            self.namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(client_configuration=config)
            _, context = kubernetes.config.list_kube_config_contexts()
            self.namespace = (context.get("context") or {}).get("namespace") or "default"
        self.config = config
        verify: bool | str = bool(config.verify_ssl) and (config.ssl_ca_cert or True)
        cert = (config.cert_file, config.key_file) if config.cert_file and config.key_file else None
        self.client = httpx.AsyncClient(base_url=config.host, verify=verify, cert=cert,
                                        trust_env=False, timeout=httpx.Timeout(30.0))

    def headers(self) -> dict[str, str]:
        """The bearer token, read again when the loader says it expired (projected service
        account tokens rotate)."""
        if self.config.refresh_api_key_hook is not None:
            self.config.refresh_api_key_hook(self.config)
        token = self.config.get_api_key_with_prefix("BearerToken", alias="authorization")
        return {"Authorization": token} if token else {}


class KubernetesDiscovery(Discovery):
    """Ready pods matching one label selector per role. `interval`: how often the router syncs
    its pools from what the watches saw (in memory; the API is not asked each time)."""

    def __init__(self, api: KubeApi, namespace: str | None, selectors: Mapping[Role, str],
                 interval: float = 0.5, retry_s: float = 2.0) -> None:
        self.api, self.namespace = api, namespace or api.namespace
        self.selectors, self.interval, self.retry_s = dict(selectors), interval, retry_s
        self.pods: dict[Role, dict[str, dict[str, Any]] | None] = {role: None for role in ROLES}

    async def discover(self, role: Role) -> list[WorkerAddress]:
        pods = self.pods[role]
        if pods is None:
            raise OSError(f"no list of {role} pods yet ({self.selectors[role]!r} in "
                          f"namespace {self.namespace})")
        found = (worker_address(role, pod) for _, pod in sorted(pods.items()))
        return [address for address in found if address is not None]

    async def watch(self) -> None:
        await asyncio.gather(*(self._follow(role) for role in ROLES))

    async def close(self) -> None:
        await self.api.client.aclose()

    async def _follow(self, role: Role) -> None:
        """List, then watch from there; again and again (cancel to stop)."""
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        while True:
            try:
                version = await self._list(role, path)
                await self._watch(role, path, version)
            except (httpx.HTTPError, ValueError, KeyError) as e:
                log.warning("watching %s pods (%s) failed, listing again in %.0f s: %s",
                            role, self.selectors[role], self.retry_s, e)
                await asyncio.sleep(self.retry_s)

    async def _list(self, role: Role, path: str) -> str:
        response = await self.api.client.get(
            path, params={"labelSelector": self.selectors[role]}, headers=self.api.headers())
        response.raise_for_status()
        body = response.json()
        self.pods[role] = {pod["metadata"]["name"]: pod for pod in body.get("items") or []}
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, role: Role, path: str, version: str) -> None:
        params = {"labelSelector": self.selectors[role], "watch": "true",
                  "resourceVersion": version, "timeoutSeconds": str(WATCH_TIMEOUT_S)}
        timeout = httpx.Timeout(30.0, read=WATCH_TIMEOUT_S + 30)
        async with self.api.client.stream("GET", path, params=params, timeout=timeout,
                                          headers=self.api.headers()) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                pod, kind = event.get("object") or {}, event.get("type")
                if kind == "ERROR":  # e.g. 410 Gone: our resourceVersion is too old
                    raise ValueError(f"watch error: {pod.get('message', pod)}")
                pods = self.pods[role]
                if pods is None or kind == "BOOKMARK":
                    continue
                if kind == "DELETED":
                    pods.pop(pod["metadata"]["name"], None)
                else:
                    pods[pod["metadata"]["name"]] = pod


def worker_address(role: Role, pod: Mapping[str, Any]) -> WorkerAddress | None:
    """The pod as a worker, or None while it is not one (not Ready, no IP, terminating, or
    no container port named "http")."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or [])
    ip = status.get("podIP")
    if not ready or not ip or meta.get("deletionTimestamp"):
        return None
    ports = {p.get("name"): int(p["containerPort"])
             for c in (pod.get("spec") or {}).get("containers") or []
             for p in c.get("ports") or [] if p.get("name") and p.get("containerPort")}
    if "http" not in ports:
        log.debug("pod %s has no container port named http; not a worker", meta.get("name"))
        return None
    bootstrap = ports.get("bootstrap", DEFAULT_BOOTSTRAP_PORT) if role == "prefill" else None
    return WorkerAddress(address_url(ip, ports["http"]), bootstrap)
