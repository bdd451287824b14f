"""Operator settings read once from the environment into one typed object."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from baton_operator.policy import PodPolicy


@dataclass(frozen=True)
class OperatorConfig:
    resync_seconds: float = 60.0  # level-based re-reconcile of every service (safety net)
    retry_seconds: float = 15.0  # delay before retrying after a transient API error
    policy: PodPolicy = field(default_factory=PodPolicy)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> OperatorConfig:
        return cls(
            resync_seconds=float(env.get("BATON_OPERATOR_RESYNC_SECONDS", cls.resync_seconds)),
            retry_seconds=float(env.get("BATON_OPERATOR_RETRY_SECONDS", cls.retry_seconds)),
            policy=PodPolicy.from_env(env),
        )
