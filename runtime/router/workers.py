"""The workers the router knows, per role, with their readiness and in-flight load.

Discovery replaces a role's membership (`WorkerPool.sync`); health checks flip `ready`; the
proxy counts requests in and out. Everything runs on the router's one event loop, so plain
attributes need no locks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from runtime.router.config import ROLES, Role, WorkerAddress


@dataclass(eq=False)
class Worker:
    role: Role
    url: str
    bootstrap_port: int | None = None
    ready: bool = False  # until its first GET /ready answers 200
    kv_transfer: dict[str, Any] | None = None  # backend + KV layout, from its /ready
    instance_id: str | None = None  # its KV instance, from its /ready: room tickets name it
    local_prefill: bool = False  # a decode that prefills requests without a room, by its /ready
    tp: int = 1  # its tensor parallelism, by its /ready (shown: any TP pairs with any)
    revision: str | None = None  # its revision, by its /ready (shown; its KV layout pairs by it)
    unanswered: int = 0  # health polls in a row that got no answer
    in_flight: int = 0  # requests this router has sent it and not seen finish
    picks: int = 0  # times a policy chose it

    @property
    def host(self) -> str:
        """The host exactly as in the URL, without IPv6 brackets: the `bootstrap_host` of P."""
        netloc = urlsplit(self.url).netloc.rpartition("@")[2]
        host = netloc.rsplit(":", 1)[0] if not netloc.endswith("]") else netloc
        return host.removeprefix("[").removesuffix("]")


@dataclass
class WorkerPool:
    """One role's workers, keyed by URL; a worker keeps its state while discovery still sees it."""

    role: Role
    by_url: dict[str, Worker] = field(default_factory=dict)

    def sync(self, addresses: Iterable[WorkerAddress]) -> tuple[list[Worker], list[Worker]]:
        """Make the membership exactly `addresses`; returns (joined, left)."""
        wanted = {a.url: a for a in addresses}
        left = [w for url, w in self.by_url.items() if url not in wanted]
        for worker in left:
            del self.by_url[worker.url]
        joined = []
        for url, address in wanted.items():
            known = self.by_url.get(url)
            if known is not None and known.bootstrap_port == address.bootstrap_port:
                continue
            worker = Worker(self.role, url, address.bootstrap_port)
            self.by_url[url] = worker
            joined.append(worker)
        return joined, left

    def ready(self) -> list[Worker]:
        return [w for w in self.by_url.values() if w.ready]

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self.by_url.values()))

    def __len__(self) -> int:
        return len(self.by_url)


@dataclass
class Workers:
    prefill: WorkerPool = field(default_factory=lambda: WorkerPool("prefill"))
    decode: WorkerPool = field(default_factory=lambda: WorkerPool("decode"))

    def pool(self, role: Role) -> WorkerPool:
        return self.prefill if role == "prefill" else self.decode

    def all(self) -> list[Worker]:
        return [w for role in ROLES for w in self.pool(role)]

    def pairable(self) -> tuple[list[Worker], list[Worker]]:
        """The ready workers that have a ready partner of the other role able to take or send
        their KV (same transfer backend and KV layout); the router is ready when both are
        non-empty, and a policy picks a decode among those matching its prefill."""
        prefill, decode = self.prefill.ready(), self.decode.ready()
        prefill = [p for p in prefill if any(d.kv_transfer == p.kv_transfer for d in decode)]
        decode = [d for d in decode if any(p.kv_transfer == d.kv_transfer for p in prefill)]
        return prefill, decode

    def unready_reason(self) -> str | None:
        """Why no request can be served now (None: it can)."""
        missing = [role for role in ROLES if not self.pool(role).ready()]
        if missing:
            return (f"no ready {' and no ready '.join(missing)} worker (known: "
                    f"{len(self.prefill)} prefill, {len(self.decode)} decode)")
        if all(self.pairable()):
            return None
        p, d = self.prefill.ready()[0], self.decode.ready()[0]
        return (f"no ready prefill worker can send KV to a ready decode worker: prefill {p.url} "
                f"vs decode {d.url}: {kv_difference(p.kv_transfer, d.kv_transfer)}")


def kv_difference(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
    """What differs between two workers' `kv_transfer` (backend, then the layout's fields)."""
    if a is None or b is None:
        return "one of them is not a prefill/decode server (its /ready shows no kv_transfer)"
    fa = {"backend": a.get("backend"), **(a.get("layout") or {})}
    fb = {"backend": b.get("backend"), **(b.get("layout") or {})}
    return "KV " + "; ".join(f"{k} {fa.get(k)} vs {fb.get(k)}" for k in dict.fromkeys([*fa, *fb])
                             if fa.get(k) != fb.get(k))
