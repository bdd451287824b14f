"""API keys at the front door: the router and every worker can require
`Authorization: Bearer <key>` (what the OpenAI SDK sends as `api_key`).

Keys come from `--api-key KEY` (repeatable), `--api-key-file PATH` (one key per line; blank lines
and `#` comments ignored) and `$BATON_API_KEY` (comma-separated). The file is read again when it
changes (checked every RELOAD_S), so a rotated Secret mounted there takes effect without a
restart and without touching requests in flight; during a rotation list both keys for a while.
A key is compared in constant time against every key; no key is ever logged or echoed.
A key file fails closed: one that holds no key (empty, blank, comments only) or that can no
longer be read (deleted) leaves that file with no keys, so with no other key every request
outside the open paths is refused, and a warning says so at start-up and at each change.
`/health` and `/ready` stay open (probes), `/metrics` too unless `--protect-metrics`. A refusal
is a 401 in the OpenAI error shape (`code: invalid_api_key`) with `WWW-Authenticate: Bearer`.
The debug views (`/debug/...`: block hashes, pairs, stats) are the operator's: with keys on they
need the admin key (`--admin-api-key` or `$BATON_ADMIN_API_KEY`), which passes the gate
everywhere; a client's key gets a 403 there (no admin key set: nobody reads them), so one
tenant never sees what another's traffic left in a cache.
The router presents its own first key to the workers behind it (one key set per deployment).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.errors import error_body

log = logging.getLogger(__name__)

ENV = "BATON_API_KEY"
ADMIN_ENV = "BATON_ADMIN_API_KEY"
OPERATOR_PREFIX = "/debug/"  # with keys on, the admin key's alone
RELOAD_S = 5.0
PROBES = frozenset({"/health", "/ready"})


class ApiKeys:
    def __init__(self, keys: Sequence[str] = (), path: str | None = None,
                 admin: str | None = None, operator: str | None = None) -> None:
        """`operator`: a second admin credential, the operator's token derived from the
        cluster key (runtime/auth/key.py `operator_token`)."""
        self.fixed = tuple(k for k in keys if k)
        self.path = path
        self.admin = admin or None
        self.operator = operator or None
        self._from_file: tuple[str, ...] = ()
        self._mtime: float | None = None
        self._checked = 0.0
        if path is not None:
            self._reload(force=True)

    @classmethod
    def load(cls, keys: Sequence[str], path: str | None, env: Mapping[str, str] = os.environ,
             *, admin: str | None = None) -> ApiKeys:
        from_env = [k.strip() for k in env.get(ENV, "").split(",") if k.strip()]
        return cls([*keys, *from_env], path, admin or env.get(ADMIN_ENV, "").strip() or None)

    @property
    def enabled(self) -> bool:
        """Keys are required: some were given, or a key file was (even one that holds none)."""
        return bool(self.fixed) or self.path is not None

    def keys(self) -> tuple[str, ...]:
        self._reload()
        return self.fixed + self._from_file

    def presented(self) -> dict[str, str]:
        """The header this side sends to the workers behind it ({} without keys)."""
        keys = self.keys()
        return {"Authorization": f"Bearer {keys[0]}"} if keys else {}

    def allows(self, authorization: str | None) -> bool:
        """Whether this `Authorization` header carries one of the keys (always, without keys)."""
        keys = self.keys()
        if not self.enabled:
            return True
        given = bearer(authorization).encode("utf-8", "surrogatepass")
        matches = [hmac.compare_digest(given, k.encode()) for k in keys]
        return any(matches) or self.is_admin(authorization)

    def is_admin(self, authorization: str | None) -> bool:
        """Whether this header carries the admin key or the operator's token (never, when
        neither is set)."""
        given = bearer(authorization).encode("utf-8", "surrogatepass")
        held = [key for key in (self.admin, self.operator) if key is not None]
        return any([hmac.compare_digest(given, key.encode()) for key in held])

    def _reload(self, force: bool = False) -> None:
        if self.path is None or (not force and time.monotonic() - self._checked < RELOAD_S):
            return
        self._checked = time.monotonic()
        try:
            mtime = os.stat(self.path).st_mtime
            if mtime == self._mtime and not force:
                return
            lines = Path(self.path).read_text().splitlines()
        except OSError as e:
            if force:
                raise ValueError(f"--api-key-file {self.path}: {e.strerror or e}") from e
            if self._mtime is not None:  # once per disappearance, not every RELOAD_S
                self._mtime, self._from_file = None, ()
                self._warn_if_keyless(f"cannot be read ({e.strerror or e})")
            return
        self._mtime = mtime
        self._from_file = tuple(ln.strip() for ln in lines
                                if ln.strip() and not ln.strip().startswith("#"))
        if self._from_file:
            if not force:
                log.info("--api-key-file changed: %d key(s) now", len(self._from_file))
        else:
            self._warn_if_keyless("holds no key")

    def _warn_if_keyless(self, problem: str) -> None:
        log.warning("--api-key-file %s %s: %s", self.path, problem,
                    "its keys are void (the other keys still hold)" if self.fixed else
                    "there is no valid API key, so every request but the probes is refused (401) "
                    "until the file holds one")


def bearer(authorization: str | None) -> str:
    """The key an `Authorization: Bearer KEY` header carries ("" for any other header)."""
    scheme, _, given = (authorization or "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else ""


class ApiKeyGate:
    """ASGI middleware: a request outside the open paths needs one of the keys."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, protect_metrics: bool = False,
                 metrics: frozenset[str] = frozenset({"/metrics"}),
                 admin_only: frozenset[str] = frozenset()) -> None:
        """`metrics`: the paths of aggregate numbers, open like /metrics unless
        `protect_metrics` (the router's /debug/planner, which the operator's planner reads);
        `admin_only`: debug paths that need the admin key also without API keys (the router's
        /debug/probe, which sends requests wherever its body says)."""
        self.app, self.keys, self.admin_only = app, keys, admin_only
        self.open = PROBES if protect_metrics else PROBES | metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path") or ""
        if scope["type"] != "http" or path in self.open:
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        if not self.keys.allows(header):
            why = ("This server has no valid API key configured: every request is refused"
                   if not self.keys.keys() else "Incorrect API key provided" if header else
                   "Missing API key: send it as `Authorization: Bearer <key>`")
            return await _refuse(send, 401, why, "invalid_api_key")
        admin = path in self.admin_only or (path.startswith(OPERATOR_PREFIX) and self.keys.enabled)
        if admin and not self.keys.is_admin(header):
            why = ("The debug views need the admin key" if self.keys.admin is not None else
                   "The debug views need an admin key, and this server has none (start it "
                   "with --admin-api-key or $BATON_ADMIN_API_KEY)")
            return await _refuse(send, 403, why, "admin_key_required")
        return await self.app(scope, receive, send)


async def _refuse(send: Send, status: int, why: str, code: str) -> None:
    body = json.dumps(error_body(why, "invalid_request_error", code)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
