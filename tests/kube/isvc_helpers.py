"""Test-side access to the emulated cluster through the official `kubernetes` client."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

import kubernetes
import yaml
from kopf.testing import KopfRunner

NAMESPACE = "serving"  # where the tests' services live and the operator watches
OperatorFactory = Callable[[], AbstractContextManager[KopfRunner]]
REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "charts" / "baton" / "crds" / "inferenceservices.baton.dev.yaml"
SAMPLE_FILE = REPO / "manifests" / "samples" / "inferenceservice.yaml"
GROUP, VERSION, PLURAL = "baton.dev", "v1alpha1", "inferenceservices"
MERGE = "application/merge-patch+json"
T = TypeVar("T")

CHILD_PLURALS = ("deployments", "services", "ingresses", "horizontalpodautoscalers",
                 "poddisruptionbudgets", "networkpolicies")
# What a minimal service turns into (docs/operator.md "Children").
CORE_CHILDREN = {
    ("Deployment", "{n}-prefill"), ("Deployment", "{n}-decode"), ("Deployment", "{n}-router"),
    ("Service", "{n}-prefill"), ("Service", "{n}-decode"), ("Service", "{n}"),
    ("NetworkPolicy", "{n}-prefill"), ("NetworkPolicy", "{n}-decode"),
    ("NetworkPolicy", "{n}-router"), ("NetworkPolicy", "{n}-probe"),
}


def wait_for(check: Callable[[], T], timeout: float = 20,
             what: str | Callable[[], str] = "condition") -> T:
    """Poll `check` until it returns something truthy; fail after `timeout` seconds, saying
    `what` was awaited (a callable is asked then: a log read at the failure, not before)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.1)
    what = what() if callable(what) else what
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def isvc(name: str, **spec: Any) -> dict[str, Any]:
    body = {"model": {"uri": "builtin:smollm2-135m"},
            "prefill": {"replicas": 1}, "decode": {"replicas": 1}, "router": {"replicas": 1}}
    body.update(spec)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService",
            "metadata": {"name": name}, "spec": body}


def deployment_of(body: dict[str, Any], role: str) -> str:
    """The name the operator gives the Deployment of `role` for the InferenceService `body`
    (a worker pool's carries the revision of the spec: `<name>-<role>-<revision>`)."""
    from baton_operator.builders.common import deployment_name
    from baton_operator.builders.pods import spec_revision
    from baton_operator.spec import parse_service

    svc = parse_service({**body, "metadata": {"namespace": NAMESPACE, **body["metadata"]}})
    return deployment_name(svc, role, None if role == "router" else spec_revision(svc))  # type: ignore[arg-type]


class Cluster:
    """The handful of calls the tests make, each returning plain dicts."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        config = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(client_configuration=config)
        self.client = kubernetes.client.ApiClient(config)
        self.custom = kubernetes.client.CustomObjectsApi(self.client)
        self.apps = kubernetes.client.AppsV1Api(self.client)
        self.core = kubernetes.client.CoreV1Api(self.client)
        networking = kubernetes.client.NetworkingV1Api(self.client)
        autoscaling = kubernetes.client.AutoscalingV2Api(self.client)
        policy = kubernetes.client.PolicyV1Api(self.client)
        # kind -> (read, list) of the child kinds
        self.calls: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
            "Deployment": (self.apps.read_namespaced_deployment,
                           self.apps.list_namespaced_deployment),
            "Service": (self.core.read_namespaced_service, self.core.list_namespaced_service),
            "Ingress": (networking.read_namespaced_ingress, networking.list_namespaced_ingress),
            "HorizontalPodAutoscaler": (
                autoscaling.read_namespaced_horizontal_pod_autoscaler,
                autoscaling.list_namespaced_horizontal_pod_autoscaler),
            "PodDisruptionBudget": (policy.read_namespaced_pod_disruption_budget,
                                    policy.list_namespaced_pod_disruption_budget),
            "NetworkPolicy": (networking.read_namespaced_network_policy,
                              networking.list_namespaced_network_policy),
        }

    def create_namespace(self) -> None:
        self.core.create_namespace({"apiVersion": "v1", "kind": "Namespace",
                                    "metadata": {"name": self.namespace}})

    def install_crd(self) -> dict[str, Any]:
        crd = yaml.safe_load(CRD_FILE.read_text())
        api = kubernetes.client.ApiextensionsV1Api(self.client)
        return self._plain(api.create_custom_resource_definition(crd))

    # -- InferenceService ----------------------------------------------------------------

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return dict(self.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, copy.deepcopy(body)))

    def get(self, name: str) -> dict[str, Any] | None:
        try:
            return dict(self.custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name))
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def patch(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return dict(self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name, patch, _content_type=MERGE))

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        obj = self.get(name) or {}
        for cond in (obj.get("status") or {}).get("conditions") or []:
            if cond["type"] == kind:
                return dict(cond)
        return {}

    # -- children ------------------------------------------------------------------------

    def child(self, kind: str, name: str) -> dict[str, Any] | None:
        try:
            return self._plain(self.calls[kind][0](name, self.namespace))
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def pool(self, name: str, role: str) -> dict[str, Any] | None:
        """The Deployment of service `name`'s `role` pool: a worker pool has one per revision
        (`<name>-<role>-<revision>`), so this is the one there is (None: none yet); two, as
        in a rollout, fail the test, which should then look at them by name."""
        if role == "router":
            return self.child("Deployment", f"{name}-router")
        found = self._plain(self.apps.list_namespaced_deployment(
            self.namespace, label_selector=f"app.kubernetes.io/name=baton,"
            f"app.kubernetes.io/instance={name},baton.dev/role={role}"))["items"]
        assert len(found) <= 1, [d["metadata"]["name"] for d in found]
        return found[0] if found else None

    def pool_name(self, name: str, role: str) -> str:
        """The name of `pool`'s Deployment (waiting up to 20 s for it)."""
        return str(wait_for(lambda: self.pool(name, role), 20,
                            f"{name}'s {role} Deployment")["metadata"]["name"])

    def children(self, pooled: bool = False) -> dict[tuple[str, str], dict[str, Any]]:
        """Every object of the child kinds in the namespace, by (kind, name); `pooled`: a
        worker pool's Deployment of its revision (`<name>-<role>-<revision>`) by its pool's
        name `<name>-<role>`, and two of one pool fail the test."""
        found: dict[tuple[str, str], dict[str, Any]] = {}
        for kind, (_, lister) in self.calls.items():
            for item in self._plain(lister(self.namespace))["items"]:
                name = item["metadata"]["name"]
                labels = (item["spec"].get("template") or {}).get("metadata", {}).get(
                    "labels", {}) if kind == "Deployment" else {}
                revision = labels.get("baton.dev/revision")
                if pooled and revision and name.endswith(f"-{revision}"):
                    name = name[:-len(revision) - 1]
                    assert (kind, name) not in found, f"two Deployments of pool {name}"
                found[kind, name] = item
        return found

    def versions(self) -> dict[tuple[str, str], str]:
        return {key: obj["metadata"]["resourceVersion"] for key, obj in self.children().items()}

    def set_deployment_status(self, name: str, ready: int | None = None, **extra: Any) -> None:
        """Report pods as the Deployment controller and kubelet would: all replicas updated,
        `ready` of them ready (default: all), at the Deployment's current generation."""
        dep = self.child("Deployment", name)
        assert dep is not None, f"Deployment {name} does not exist"
        replicas = dep["spec"].get("replicas", 1)
        status = {"observedGeneration": dep["metadata"]["generation"], "replicas": replicas,
                  "updatedReplicas": replicas,
                  "readyReplicas": replicas if ready is None else ready,
                  "availableReplicas": replicas if ready is None else ready, **extra}
        self.apps.patch_namespaced_deployment_status(name, self.namespace, {"status": status},
                                                     _content_type=MERGE)

    def events(self) -> list[dict[str, Any]]:
        return self._plain(self.core.list_namespaced_event(self.namespace))["items"]

    def _plain(self, model: Any) -> Any:
        return self.client.sanitize_for_serialization(model)
