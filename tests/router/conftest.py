"""Router fixtures: stand-in workers and routers on loopback, stopped after each test."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from runtime.router.app import create_app
from runtime.router.args import parse_router_args
from runtime.router.discovery import Resolver
from tests.router.fake_worker import FakeWorker
from tests.router.router_process import FAST
from tests.router.server_thread import ServerThread


def stop_all(servers: list[ServerThread]) -> None:
    for s in servers:
        s.server.should_exit = True
    for s in servers:
        s.stop()


def wait_for(predicate: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class RouterThread:
    """`baton router`'s app, built from CLI args, served by uvicorn in a thread."""

    def __init__(self, argv: list[str], resolver: Resolver | None = None) -> None:
        self.config = parse_router_args([*FAST, *argv])
        self.app = create_app(self.config, resolver=resolver)
        self.server = ServerThread(self.app).start()
        self.url = self.server.url
        self.client = httpx.Client(base_url=self.url, timeout=10, trust_env=False)

    def wait_ready(self, timeout: float = 5.0) -> RouterThread:
        wait_for(lambda: self.client.get("/ready").status_code == 200, timeout, "router /ready")
        return self

    def metrics(self) -> str:
        return self.client.get("/metrics").text

    def stop(self) -> None:
        self.client.close()
        self.server.stop()


@pytest.fixture
def workers() -> Iterator[Callable[..., FakeWorker]]:
    """Factory: `workers("prefill")` starts a stand-in worker; all stop after the test."""
    started: list[FakeWorker] = []

    def start(role: str, **kwargs: Any) -> FakeWorker:
        worker = FakeWorker(role, **kwargs).start()
        started.append(worker)
        return worker

    yield start
    stop_all([w.server for w in started])


@pytest.fixture
def router() -> Iterator[Callable[..., RouterThread]]:
    """Factory: `router(prefill_workers, decode_workers, "--policy", "prefix")` starts an
    in-process router over those stand-ins and waits until it is ready."""
    started: list[RouterThread] = []

    def start(prefill: list[FakeWorker], decode: list[FakeWorker], *flags: str,
              ready: bool = True) -> RouterThread:
        argv = [*(a for w in prefill for a in ("--prefill", w.arg)),
                *(a for w in decode for a in ("--decode", w.arg)), *flags]
        r = RouterThread(argv)
        started.append(r)
        return r.wait_ready() if ready else r

    yield start
    for r in started:
        r.client.close()
    stop_all([r.server for r in started])


@pytest.fixture
def pd(workers: Callable[..., FakeWorker],
       router: Callable[..., RouterThread]) -> tuple[RouterThread, FakeWorker, FakeWorker]:
    """One prefill, one decode, a round_robin router in front."""
    p, d = workers("prefill"), workers("decode")
    return router([p], [d]), p, d
