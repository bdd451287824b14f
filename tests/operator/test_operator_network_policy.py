"""The NetworkPolicies, checked by what they let through rather than by their text.

A small evaluator of networking.k8s.io/v1 semantics (a pod selected by an Ingress policy is
isolated; it accepts the union of its policies' rules; a bare podSelector peer means the
policy's namespace) runs over a cluster of real pod templates: two services in one namespace,
a service of the same name in another namespace, a stranger pod, an ingress controller and a
Prometheus. Every (source pod, destination pod, port) it allows into a service's pods must be
exactly the set docs/operator.md promises, no more and no less.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
from baton_operator.builders import build_children, build_deployment, optional_children
from baton_operator.builders.workloads import build_probe_deployment
from baton_operator.spec import ROLES, WORKER_ROLES, InferenceService, parse_service

UCX = range(20000, 20016)
PROBED_PORTS = (22, 8000, 8997, 8998, 8999, 9000, 9001, 19999, 20000, 20007, 20015, 20016)
NAMESPACES = {"serving": {"kubernetes.io/metadata.name": "serving"},
              "other": {"kubernetes.io/metadata.name": "other"},
              "ingress-nginx": {"kubernetes.io/metadata.name": "ingress-nginx"},
              "monitoring": {"kubernetes.io/metadata.name": "monitoring", "team": "obs"}}
INGRESS_CONTROLLER = [{"namespaceSelector": {"matchLabels": {
                           "kubernetes.io/metadata.name": "ingress-nginx"}},
                       "podSelector": {"matchLabels": {"app": "ingress-nginx"}}}]
PROMETHEUS = [{"namespaceSelector": {"matchExpressions": [
                   {"key": "team", "operator": "In", "values": ["obs"]}]}}]


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: tuple[tuple[str, str], ...]


def service(name: str, namespace: str, **spec: Any) -> InferenceService:
    spec.setdefault("model", {"uri": "builtin:smollm2-135m"})
    return parse_service({"metadata": {"name": name, "namespace": namespace, "uid": "u"},
                          "spec": spec})


def pods_of(svc: InferenceService) -> list[Pod]:
    """One pod per pool, and the rollout gate's two probe pods, labelled as their
    Deployments' templates say."""
    pods = []
    for role in ROLES:
        labels = build_deployment(svc, role)["spec"]["template"]["metadata"]["labels"]
        pods.append(Pod(f"{svc.namespace}/{svc.name}-{role}", svc.namespace,
                        tuple(sorted(labels.items()))))
    for role in WORKER_ROLES:
        labels = build_probe_deployment(svc, role)["spec"]["template"]["metadata"]["labels"]
        pods.append(Pod(f"{svc.namespace}/{svc.name}-{role}-probe", svc.namespace,
                        tuple(sorted(labels.items()))))
    return pods


def matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """metav1.LabelSelector semantics ({} matches everything)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for term in selector.get("matchExpressions") or []:
        present, value = term["key"] in labels, labels.get(term["key"])
        ok = {"In": present and value in term.get("values", ()),
              "NotIn": not present or value not in term.get("values", ()),
              "Exists": present, "DoesNotExist": not present}[term["operator"]]
        if not ok:
            return False
    return True


def peer_matches(peer: Mapping[str, Any], policy_ns: str, source: Pod) -> bool:
    if "ipBlock" in peer:
        return False  # addresses, not pods: never one of ours by selector
    if "namespaceSelector" in peer:
        if not matches(peer["namespaceSelector"], NAMESPACES[source.namespace]):
            return False
    elif source.namespace != policy_ns:
        return False
    return matches(peer.get("podSelector") or {}, dict(source.labels))


def port_matches(rule: Mapping[str, Any], port: int) -> bool:
    if "ports" not in rule:
        return True
    return any(p.get("protocol", "TCP") == "TCP"
               and p["port"] <= port <= p.get("endPort", p["port"]) for p in rule["ports"])


def allowed(policies: list[dict[str, Any]], pods: list[Pod]) -> set[tuple[str, str, int]]:
    """Every (source, destination, port) let in, for the destinations some policy isolates."""
    edges = set()
    for dst in pods:
        selecting = [p for p in policies if p["metadata"]["namespace"] == dst.namespace
                     and "Ingress" in p["spec"]["policyTypes"]
                     and matches(p["spec"]["podSelector"], dict(dst.labels))]
        for policy in selecting:
            for rule in policy["spec"].get("ingress") or []:
                for src in pods:
                    if "from" in rule and not any(
                            peer_matches(peer, dst.namespace, src) for peer in rule["from"]):
                        continue
                    edges |= {(src.name, dst.name, port) for port in PROBED_PORTS
                              if port_matches(rule, port)}
    return edges


def promised(svc: InferenceService, pods: list[Pod], *, router_from: list[str] | None,
             metrics_from: list[str]) -> set[tuple[str, str, int]]:
    """What docs/operator.md says each of `svc`'s pods accepts, written out by hand."""
    me = f"{svc.namespace}/{svc.name}"
    everyone = [p.name for p in pods]
    nixl = [port for port in PROBED_PORTS if port in UCX] if svc.kv_backend == "nixl" else []
    kv = [8999 + rank for rank in range(svc.decode.tensor_parallel_size)]  # a port per rank
    edges = {(src, f"{me}-router", 8000) for src in (everyone if router_from is None
                                                       else router_from + metrics_from)}
    edges |= {(src, f"{me}-{role}", 8000) for role in ("prefill", "decode")
              for src in [f"{me}-router", *metrics_from]}
    edges |= {(f"{me}-decode", f"{me}-prefill", port) for port in [8998, *nixl]}
    edges |= {(f"{me}-prefill", f"{me}-decode", port) for port in [*kv, *nixl]}
    # a draining decode moves its streams' KV to another decode (of the same pool)
    edges |= {(f"{me}-decode", f"{me}-decode", port) for port in [8998, *kv, *nixl]}
    # the gate's probe pods: the router's probes, and the KV plane between the two of them
    probes = [f"{me}-prefill-probe", f"{me}-decode-probe"]
    edges |= {(f"{me}-router", probe, 8000) for probe in probes}
    edges |= {(src, dst, port) for src in probes for dst in probes for port in [8998, *kv, *nixl]}
    return edges


def into(edges: Iterable[tuple[str, str, int]], svc: InferenceService) -> set[tuple[str, str, int]]:
    prefix = f"{svc.namespace}/{svc.name}-"
    return {e for e in edges if e[1].startswith(prefix)}


@pytest.mark.parametrize(("backend", "decode_tp"), [("nixl", 1), ("tcp", 1), ("tcp", 2)])
@pytest.mark.parametrize("fenced", [False, True], ids=["router-open", "router-fenced"])
def test_each_pod_accepts_exactly_its_service_peers_on_exactly_its_ports(
        backend: str, decode_tp: int, fenced: bool) -> None:
    fence: dict[str, Any] = {"metricsFrom": PROMETHEUS}
    if fenced:
        fence["routerFrom"] = INGRESS_CONTROLLER
    llm = service("llm", "serving", kvTransfer={"backend": backend}, networkPolicy=fence,
                  model={"uri": "hf://org/name"}, decode={"tensorParallelSize": decode_tp})
    chat = service("chat", "serving", kvTransfer={"backend": backend})  # a neighbour
    twin = service("llm", "other", kvTransfer={"backend": backend})  # same name, elsewhere
    extras = [Pod("serving/stranger", "serving", ()),
              Pod("serving/fake-ingress", "serving", (("app", "ingress-nginx"),)),
              Pod("ingress-nginx/controller", "ingress-nginx", (("app", "ingress-nginx"),)),
              Pod("monitoring/prometheus", "monitoring", (("app", "prometheus"),))]
    pods = [*pods_of(llm), *pods_of(chat), *pods_of(twin), *extras]
    policies = [c for svc in (llm, chat, twin) for c in build_children(svc)
                if c["kind"] == "NetworkPolicy"]
    assert len(policies) == 12
    edges = allowed(policies, pods)
    assert into(edges, llm) == promised(
        llm, pods, router_from=["ingress-nginx/controller"] if fenced else None,
        metrics_from=["monitoring/prometheus"])
    for neighbour in (chat, twin):  # no metricsFrom, router open: the defaults
        assert into(edges, neighbour) == promised(neighbour, pods, router_from=None,
                                                  metrics_from=[])
    # each policy selects its own pool's pods and nobody else's
    for policy in policies:
        selected = {p.name for p in pods if p.namespace == policy["metadata"]["namespace"]
                    and matches(policy["spec"]["podSelector"], dict(p.labels))}
        mine = f"{policy['metadata']['namespace']}/{policy['metadata']['name']}"
        assert selected == ({f"{mine[:-len('-probe')]}-{role}-probe" for role in WORKER_ROLES}
                            if mine.endswith("-probe") else {mine})


def test_a_disabled_fence_renders_no_policy_and_deletes_the_old_ones() -> None:
    svc = service("llm", "serving", networkPolicy={"enabled": False})
    assert not [c for c in build_children(svc) if c["kind"] == "NetworkPolicy"]
    # ...and the ones an earlier spec made are optional children: the operator deletes them
    made = {("networking.k8s.io/v1", "NetworkPolicy", f"llm-{role}") for role in ROLES}
    assert made <= set(optional_children(svc))


def test_the_evaluator_isolates_and_unions() -> None:
    """The evaluator itself: a deny-all policy isolates; a second policy adds to the first."""
    pods = [Pod("serving/a", "serving", (("x", "1"),)), Pod("serving/b", "serving", ())]
    deny = {"metadata": {"namespace": "serving"},
            "spec": {"podSelector": {"matchLabels": {"x": "1"}}, "policyTypes": ["Ingress"],
                     "ingress": []}}
    assert allowed([deny], pods) == set()
    allow = {"metadata": {"namespace": "serving"},
             "spec": {"podSelector": {}, "policyTypes": ["Ingress"],
                      "ingress": [{"from": [{"podSelector": {}}], "ports": [{"port": 22}]}]}}
    assert allowed([deny, allow], pods) == {(s, d, 22) for s in ("serving/a", "serving/b")
                                            for d in ("serving/a", "serving/b")}
