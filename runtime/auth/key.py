"""The cluster key: one secret shared by the router and the workers of one deployment.

Read once at start-up from `--cluster-key-file PATH` or `$BATON_CLUSTER_KEY_FILE` (the operator
mounts the service's Secret and points that there), or `$BATON_CLUSTER_KEY` (`baton up` sets it
for its children). Every use derives its own subkey
(`mac(purpose, ...)`), so a MAC made for one purpose never verifies for another. Without a key
(a developer's processes) `ClusterKey.none()` stands in: nothing is required, and MACs made with
the empty key still bind the ids they name (the KV link handshake runs either way).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "BATON_CLUSTER_KEY"
FILE_ENV = "BATON_CLUSTER_KEY_FILE"  # where the operator mounts the service's Secret
MIN_BYTES = 16


class KeyProblem(ValueError):
    """The key cannot be used (unreadable file, too short): the message says which and why."""


@dataclass(frozen=True)
class ClusterKey:
    secret: bytes = field(repr=False)

    @classmethod
    def none(cls) -> ClusterKey:
        return cls(b"")

    @property
    def enabled(self) -> bool:
        return bool(self.secret)

    def mac(self, purpose: str, *parts: bytes | str) -> bytes:
        """HMAC-SHA256 under this key's subkey for `purpose`, over `parts` (length-prefixed, so
        ("ab", "c") and ("a", "bc") differ)."""
        sub = hmac.new(self.secret, b"baton/" + purpose.encode(), hashlib.sha256).digest()
        h = hmac.new(sub, digestmod=hashlib.sha256)
        for part in parts:
            data = part.encode() if isinstance(part, str) else part
            h.update(len(data).to_bytes(4, "big"))
            h.update(data)
        return h.digest()

    def verify(self, mac: bytes, purpose: str, *parts: bytes | str) -> bool:
        return hmac.compare_digest(mac, self.mac(purpose, *parts))

    def operator_token(self) -> str | None:
        """The bearer token the operator (which holds the service's Secret) presents to the
        router's admin-only views, e.g. the rollout gate's `/debug/probe`; None without a
        key. Derived, so no second Secret has to be made, mounted or rotated."""
        return self.mac("operator-admin").hex() if self.enabled else None


def load_cluster_key(path: str | None, env: Mapping[str, str] = os.environ) -> ClusterKey:
    """The key from the file at `path` (else at $BATON_CLUSTER_KEY_FILE), else from
    $BATON_CLUSTER_KEY, else none."""
    flag = "--cluster-key-file" if path else f"${FILE_ENV}"
    path = path or env.get(FILE_ENV)
    if path:
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as e:
            raise KeyProblem(f"{flag} {path}: {e.strerror or e}") from e
        where = f"{flag} {path}"
    elif env.get(ENV):
        secret, where = env[ENV].strip().encode(), f"${ENV}"
    else:
        return ClusterKey.none()
    if len(secret) < MIN_BYTES:
        raise KeyProblem(f"{where}: the cluster key has {len(secret)} bytes; use at least "
                         f"{MIN_BYTES} random bytes (e.g. `openssl rand -hex 32`)")
    return ClusterKey(secret)


def warn_if_open(key: ClusterKey, what: str) -> None:
    if not key.enabled:
        log.warning("NO CLUSTER KEY: %s accepts KV-plane calls from anyone who can reach it "
                    "(set --cluster-key-file or $%s; `baton up` and the operator do)", what, ENV)


class ReplayCache:
    """Tokens seen before, each kept until it expires: a token is accepted once. Thread-safe;
    when full of unexpired tokens it refuses new ones (fails closed)."""

    def __init__(self, most: int = 1 << 20) -> None:
        self.seen: dict[bytes, float] = {}
        self.most = most
        self._lock = threading.Lock()

    def first_use(self, token: bytes, expires: float, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        with self._lock:
            if len(self.seen) >= self.most or len(self.seen) % 1024 == 0:
                self.seen = {t: e for t, e in self.seen.items() if e > now}
            if token in self.seen or len(self.seen) >= self.most:
                return False
            self.seen[token] = expires
            return True
