"""Operator settings read once from the environment into one typed object."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorConfig:
    resync_seconds: float = 60.0  # level-based re-reconcile of every service (drift repair)
    retry_seconds: float = 15.0  # delay before retrying after a transient API error

    @classmethod
    def from_env(cls) -> OperatorConfig:
        return cls(
            resync_seconds=float(os.environ.get("BATON_OPERATOR_RESYNC_SECONDS", cls.resync_seconds)),
            retry_seconds=float(os.environ.get("BATON_OPERATOR_RETRY_SECONDS", cls.retry_seconds)),
        )
