"""Where the workers are: one small interface, one implementation per source.

A `Discovery` answers "which workers does this role have now?"; `run_discovery` asks it every
`interval` seconds and syncs the `Workers`. Static lists never change; a DNS name is resolved
again each time (every A/AAAA record is a worker `http://IP:PORT`, so pods behind a headless
Service join and leave as the records change). `--discovery kubernetes` reads Ready pods by
label selector through the API (`runtime/router/kubernetes.py`); its watches run in
`Discovery.watch`, and `discover` answers from what they saw. The app picks one by its config
(`app.build_discovery`), so the kubernetes client is imported only where it is used.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable

from runtime.router.config import ROLES, DnsName, Role, WorkerAddress
from runtime.router.workers import Worker, Workers

log = logging.getLogger("baton.router")

# host, port -> the IP addresses it resolves to now (raises OSError when it cannot resolve)
Resolver = Callable[[str, int], Awaitable[list[str]]]
# (joined, left) after a refresh that changed the membership
OnChange = Callable[[list[Worker], list[Worker]], Awaitable[None]]


class Discovery(ABC):
    """The workers of each role. `interval` is how often to ask again (None: never)."""

    interval: float | None = None

    @abstractmethod
    async def discover(self, role: Role) -> list[WorkerAddress]:
        """The role's workers now. Raising keeps the previous membership (a DNS hiccup must
        not empty the pool)."""

    async def watch(self) -> None:  # noqa: B027 - optional: most sources have nothing to watch
        """Background work that keeps `discover` current (runs while the router serves)."""

    async def close(self) -> None:  # noqa: B027
        """Release what `watch` held (connections); called once the router stops."""


class StaticDiscovery(Discovery):
    def __init__(self, prefill: tuple[WorkerAddress, ...], decode: tuple[WorkerAddress, ...]):
        self.addresses = {"prefill": list(prefill), "decode": list(decode)}

    async def discover(self, role: Role) -> list[WorkerAddress]:
        return list(self.addresses[role])


async def getaddrinfo_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def address_url(ip: str, port: int) -> str:
    literal = f"[{ip}]" if ipaddress.ip_address(ip.split("%")[0]).version == 6 else ip
    return f"http://{literal}:{port}"


class DnsDiscovery(Discovery):
    """Roles given as DNS names, re-resolved every `interval`; a role given as a static list
    keeps it (so `--prefill URL --decode-dns NAME` works too)."""

    def __init__(self, names: dict[Role, DnsName], static: StaticDiscovery, interval: float,
                 resolver: Resolver = getaddrinfo_resolver):
        self.names, self.static, self.interval = names, static, interval
        self.resolver = resolver

    async def discover(self, role: Role) -> list[WorkerAddress]:
        name = self.names.get(role)
        if name is None:
            return await self.static.discover(role)
        ips = dict.fromkeys(await self.resolver(name.host, name.port))  # ordered, unique
        return [WorkerAddress(address_url(ip, name.port), name.bootstrap_port) for ip in ips]


async def refresh(discovery: Discovery, workers: Workers) -> tuple[list[Worker], list[Worker]]:
    """Ask `discovery` once per role and sync; returns the workers that (joined, left)."""
    joined_all: list[Worker] = []
    left_all: list[Worker] = []
    for role in ROLES:
        try:
            addresses = await discovery.discover(role)
        except (OSError, ValueError) as e:
            log.warning("discovering %s workers failed (keeping %d known): %s",
                        role, len(workers.pool(role)), e)
            continue
        joined, left = workers.pool(role).sync(addresses)
        for w in joined:
            log.info("%s worker joined: %s", role, w.url)
        for w in left:
            log.info("%s worker left: %s", role, w.url)
        joined_all += joined
        left_all += left
    return joined_all, left_all


async def run_discovery(discovery: Discovery, workers: Workers, on_change: OnChange) -> None:
    """Refresh now, then every `discovery.interval` seconds (forever; cancel to stop)."""
    while True:
        joined, left = await refresh(discovery, workers)
        if joined or left:
            await on_change(joined, left)
        if discovery.interval is None:
            return
        await asyncio.sleep(discovery.interval)
