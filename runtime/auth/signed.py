"""Signed bootstrap calls: a decode proves the cluster key on every state-changing call it makes
to a prefill's bootstrap server (POST /peers, POST /rooms, DELETE /rooms/<room>).

    X-Baton-Signature: v1 <unix seconds> <nonce, 32 hex> <MAC, hex>
    MAC = key.mac("bootstrap-call", method, path, seconds, nonce, body)

The server accepts a call whose MAC verifies, whose time is within WINDOW_S of its own clock and
whose MAC it has not seen before (kept until the window has passed): a recorded call cannot be
replayed, nor its body or path changed. 401 without the header, 403 for a bad one. Without a
cluster key nothing is signed or checked.
"""

from __future__ import annotations

import secrets
import time

from runtime.auth.key import ClusterKey, ReplayCache

HEADER = "X-Baton-Signature"
PURPOSE = "bootstrap-call"
WINDOW_S = 60.0


def sign_call(key: ClusterKey, method: str, path: str, body: bytes) -> dict[str, str]:
    """The header for this call ({} without a key)."""
    if not key.enabled:
        return {}
    now, nonce = str(int(time.time())), secrets.token_hex(16)
    mac = key.mac(PURPOSE, method, path, now, nonce, body).hex()
    return {HEADER: f"v1 {now} {nonce} {mac}"}


class CallGate:
    """The bootstrap server's check of signed calls."""

    def __init__(self, key: ClusterKey) -> None:
        self.key = key
        self.seen = ReplayCache()

    def problem(self, header: str | None, method: str, path: str, body: bytes,
                now: float | None = None) -> tuple[int, str] | None:
        """None when the call may proceed, else (401 or 403, why)."""
        if not self.key.enabled:
            return None
        if not header:
            return 401, f"{method} {path} needs the {HEADER} of a decode server of this deployment"
        try:
            version, stamp, nonce, mac_hex = header.split(" ")
            when, mac = int(stamp), bytes.fromhex(mac_hex)
        except ValueError:
            return 403, f"a malformed {HEADER}"
        now = time.time() if now is None else now
        if version != "v1" or not self.key.verify(mac, PURPOSE, method, path, stamp, nonce, body):
            return 403, f"{HEADER} does not verify with this deployment's cluster key"
        if abs(now - when) > WINDOW_S:
            return 403, f"{HEADER} is {now - when:+.0f} s off this server's clock"
        if not self.seen.first_use(mac, when + 2 * WINDOW_S, now):
            return 403, f"{HEADER} was used before (a replayed call)"
        return None
