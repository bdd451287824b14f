"""One ingress NetworkPolicy per pool (`spec.networkPolicy`, on by default).

What each pool's pods accept, and from whom (all else is dropped by a CNI that enforces
NetworkPolicy; egress is left open: routers call the API server, workers pull models):

- router:  its HTTP port from anywhere, or only from `routerFrom` (e.g. the ingress controller)
           and `metricsFrom`;
- prefill: HTTP from this service's routers; bootstrap from this service's decodes;
- decode:  HTTP from this service's routers; the KV ports (one per TP rank) from this
           service's prefills; the bootstrap and KV ports from this service's decodes (a draining decode moves its
           streams' KV to another: runtime/disagg/move.py);
- nixl:    UCX's port range between this service's prefills and decodes, both ways, and
           between its decodes;
- workers: HTTP (which serves /metrics) from `metricsFrom` as well;
- probe:   the rollout gate's probe pods (`app.kubernetes.io/name: baton-probe`, which no
           other policy selects): HTTP from this service's routers, the KV plane between them.

Peers are named by the pools' selector labels, which carry the service's name, so no pod of
another service (or another namespace: a bare podSelector stays in the policy's namespace)
matches. Kubelet probes come from the node, which NetworkPolicy always lets through.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from baton_operator.builders.common import (
    BOOTSTRAP_PORT,
    HTTP_PORT,
    LABEL_INSTANCE,
    LABEL_NAME,
    PROBING,
    UCX_PORT_RANGE,
    child_name,
    kv_ports,
    metadata,
    selector_labels,
)
from baton_operator.spec import ROLES, InferenceService, Role

API = "networking.k8s.io/v1"
KIND = "NetworkPolicy"


def build_network_policies(svc: InferenceService) -> list[dict[str, Any]]:
    """One policy per pool and one for the gate's probe pods, or none when
    `spec.networkPolicy.enabled` is false."""
    if not svc.network_policy.enabled:
        return []
    return [*(_policy(svc, role, _rules(svc, role)) for role in ROLES), _probe_policy(svc)]


def network_policy_keys(svc: InferenceService) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of every policy `build_network_policies` may build."""
    return [*((API, KIND, child_name(svc, role)) for role in ROLES), (API, KIND, _probe(svc))]


def _probe(svc: InferenceService) -> str:
    return f"{svc.name}-probe"


def _probe_policy(svc: InferenceService) -> dict[str, Any]:
    """The gate's probe pods: the router's probes in, and the KV plane between the probe
    prefill and the probe decode (bootstrap, KV receivers, UCX), nothing else."""
    probes = {LABEL_NAME: PROBING, LABEL_INSTANCE: svc.name}
    kv = kv_ports(svc.decode.tensor_parallel_size)
    plane = [_port(BOOTSTRAP_PORT), _port(kv[0], kv[-1]) if len(kv) > 1 else _port(kv[0])]
    if svc.kv_backend == "nixl":
        plane.append(_port(*UCX_PORT_RANGE))
    policy = _policy(svc, "decode", [_rule([_pods(svc, "router")], [_port(HTTP_PORT)]),
                                     _rule([{"podSelector": {"matchLabels": probes}}], plane)])
    policy["metadata"]["name"] = _probe(svc)
    policy["metadata"]["labels"]["app.kubernetes.io/component"] = "probe"
    policy["spec"]["podSelector"] = {"matchLabels": probes}
    return policy


def _rules(svc: InferenceService, role: Role) -> list[dict[str, Any]]:
    fence = svc.network_policy
    http = [_port(HTTP_PORT)]
    if role == "router":
        if fence.router_from is None:
            return [{"ports": http}]  # no `from`: every source
        rules = [_rule(fence.router_from, http)]
    else:
        peer: Role = "decode" if role == "prefill" else "prefill"
        ucx = [_port(*UCX_PORT_RANGE)] if svc.kv_backend == "nixl" else []
        kv = kv_ports(svc.decode.tensor_parallel_size)  # one receiver per decode rank
        kv_port = _port(kv[0], kv[-1]) if len(kv) > 1 else _port(kv[0])
        kv_plane = [_port(BOOTSTRAP_PORT) if role == "prefill" else kv_port, *ucx]
        rules = [_rule([_pods(svc, "router")], http), _rule([_pods(svc, peer)], kv_plane)]
        if role == "decode":
            moves = [_port(BOOTSTRAP_PORT), kv_port, *ucx]
            rules.append(_rule([_pods(svc, "decode")], moves))
    if fence.metrics_from:
        rules.append(_rule(fence.metrics_from, http))
    return rules


def _policy(svc: InferenceService, role: Role, rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": API, "kind": KIND, "metadata": metadata(svc, child_name(svc, role), role),
            "spec": {"podSelector": {"matchLabels": selector_labels(svc, role)},
                     "policyTypes": ["Ingress"], "ingress": rules}}


def _rule(sources: Sequence[Mapping[str, Any]], ports: list[dict[str, Any]]) -> dict[str, Any]:
    return {"from": copy.deepcopy([dict(source) for source in sources]), "ports": ports}


def _pods(svc: InferenceService, role: Role) -> dict[str, Any]:
    """This service's pods of one pool (a bare podSelector: the policy's own namespace)."""
    return {"podSelector": {"matchLabels": selector_labels(svc, role)}}


def _port(port: int, end: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"protocol": "TCP", "port": port}
    if end is not None:
        spec["endPort"] = end
    return spec
