"""Operator settings read once from the environment into one typed object."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from baton_operator.policy import PodPolicy
from baton_operator.spec import Images


@dataclass(frozen=True)
class OperatorConfig:
    resync_seconds: float = 60.0  # level-based re-reconcile of every service (safety net)
    retry_seconds: float = 15.0  # delay before retrying after a transient API error
    # kopf watches CRDs to notice resources appearing at run time; that needs a ClusterRole,
    # so the chart's namespaced mode (a Role only) turns it off.
    cluster_scanning: bool = True
    policy: PodPolicy = field(default_factory=PodPolicy)
    images: Images = field(default_factory=Images)  # chart values image.cpu / image.cuda
    # What KEDA's Prometheus triggers query (chart value autoscaling.prometheusAddress);
    # empty: serving-signal autoscaling goes through the custom metrics API only.
    prometheus_url: str = ""
    metrics_port: int = 0  # the operator's own /metrics (chart value metrics.operatorPort); 0: off
    plan_seconds: float = 30.0  # how often the P:D planner reads the figures (planning.py)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> OperatorConfig:
        scanning = env.get("BATON_OPERATOR_CLUSTER_SCANNING", "true").strip().lower()
        if scanning not in ("true", "false"):
            raise ValueError(f"BATON_OPERATOR_CLUSTER_SCANNING={scanning!r}: true or false")
        return cls(
            resync_seconds=float(env.get("BATON_OPERATOR_RESYNC_SECONDS", cls.resync_seconds)),
            retry_seconds=float(env.get("BATON_OPERATOR_RETRY_SECONDS", cls.retry_seconds)),
            cluster_scanning=scanning == "true",
            policy=PodPolicy.from_env(env),
            images=Images(cpu=env.get("BATON_OPERATOR_IMAGE") or Images.cpu,
                          cuda=env.get("BATON_OPERATOR_IMAGE_CUDA") or Images.cuda),
            prometheus_url=env.get("BATON_OPERATOR_PROMETHEUS_URL", "").strip(),
            metrics_port=int(env.get("BATON_OPERATOR_METRICS_PORT") or 0),
            plan_seconds=float(env.get("BATON_OPERATOR_PLAN_SECONDS", cls.plan_seconds)),
        )
