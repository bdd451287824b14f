"""A real uvicorn server on loopback, in a thread of the test process."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from tests.ports import free_port


def free_port_on(hosts: list[str]) -> int:
    """A port that is free on every one of `hosts` (e.g. 127.0.0.1 and 127.0.0.2)."""
    for _ in range(50):
        port = free_port(hosts[0])
        try:
            for host in hosts[1:]:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on all of {hosts}")


class ServerThread:
    def __init__(self, app: Any, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.host, self.port = host, port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, host=host, port=self.port, log_level="warning",
                                access_log=False, timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True,
                                       name=f"uvicorn-{self.port}")

    def start(self, timeout: float = 10.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
