"""The emulated API server (kmock_compat.Emulator) served on loopback for a test, with the
knobs the tests turn: injected faults, admission policies, the request log, RBAC decisions."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import kmock

from tests.kube.kmock_admission import Policy
from tests.kube.kmock_compat import Emulator
from tests.kube.kmock_rbac import SA_PREFIX, Attributes


class EmulatedCluster:
    """The emulator served on 127.0.0.1:<random port> from its own thread and event loop."""

    def __init__(self) -> None:
        self.emulator: Emulator | None = None
        self.url = ""
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True,
                                        name="kmock")

    async def _serve(self) -> None:
        async with Emulator() as emulator, kmock.Server(emulator) as server:
            emulator.resources.load_bundled()
            self.emulator, self.url = emulator, str(server.url).rstrip("/")
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self._started.set()
            await self._stop.wait()

    @contextmanager
    def running(self, timeout: float = 15) -> Iterator[EmulatedCluster]:
        self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError("the emulated API server did not start")
        try:
            yield self
        finally:
            assert self._loop is not None and self._stop is not None
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout)

    @property
    def _emulator(self) -> Emulator:
        assert self.emulator is not None, "the emulated API server is not running"
        return self.emulator

    def fail(self, method: str, plural: str, times: int) -> None:
        """Answer the next `times` `method` requests on `plural` with 503."""
        self._emulator.faults[method, plural] = times

    def deny(self, name: str, plural: str, denies: Callable[[Mapping[str, Any]], bool],
             message: str) -> None:
        """Install an admission policy: writes of `plural` objects it `denies` get a 422."""
        self._emulator.policies.append(Policy(name, plural, denies, message))

    def request_count(self) -> int:
        return len(self._emulator.seen)

    def writes(self, after: int = 0, kinds: tuple[str, ...] = ()) -> list[str]:
        """`METHOD /path` of the mutating requests since the `after`-th request, optionally
        only those on resources whose plural is in `kinds`."""
        return [f"{r.method} {r.path}" for r in self._emulator.seen[after:]
                if r.method in ("POST", "PUT", "PATCH", "DELETE")
                and (not kinds or r.plural in kinds)]

    def history(self, plural: str, namespace: str, name: str) -> list[dict[str, Any]]:
        """Every stored version of an object, oldest first (deletions left out)."""
        for (resource, ns, obj_name), obj in list(self._emulator.objects.items()):
            if (resource.plural, ns, obj_name) == (plural, namespace, name):
                return [version.raw for version in obj.history.raw if version is not None]
        return []

    def rbac_decisions(self, user: str) -> list[tuple[Attributes, bool]]:
        """Every RBAC-checked request of `user`, with whether it was allowed."""
        return [(attrs, ok) for who, attrs, ok in list(self._emulator.audit) if who == user]

    def kubeconfig(self, token: str = "test-token") -> str:
        """A kubeconfig for this server; the default token is an administrator's."""
        return (
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: kmock, cluster: {{server: \"{self.url}\"}}}}]\n"
            f"users: [{{name: tester, user: {{token: \"{token}\"}}}}]\n"
            "contexts: [{name: kmock, context: {cluster: kmock, user: tester, namespace: default}}]\n"
            "current-context: kmock\n"
        )

    def service_account_kubeconfig(self, namespace: str, name: str) -> str:
        """A kubeconfig that authenticates as the ServiceAccount NAMESPACE/NAME (RBAC applies)."""
        return self.kubeconfig(f"{SA_PREFIX}{namespace}:{name}")
