"""`baton router`: parse the flags, build the app, serve it with uvicorn until SIGTERM/SIGINT.

On a signal uvicorn stops accepting, gives requests in flight `--shutdown-grace-s` to finish,
and the router exits 0. It imports no torch (docs/architecture.md "Dependency directions").
"""

from __future__ import annotations

import logging
from types import FrameType

import uvicorn

from runtime.router.app import create_app
from runtime.router.args import parse_router_args
from runtime.router.config import RouterConfig

log = logging.getLogger("baton.router")


class _Server(uvicorn.Server):
    """uvicorn, except that a signal it handled gracefully ends in exit code 0 (uvicorn
    re-raises the signal after shutting down otherwise)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            log.info("signal %d: draining requests in flight", sig)
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def serve(config: RouterConfig) -> int:
    uv_config = uvicorn.Config(
        app=create_app(config), host=config.host, port=config.port, log_level=config.log_level,
        timeout_graceful_shutdown=max(1, round(config.shutdown_grace_s)), access_log=False)
    log.info("router on http://%s:%d, policy %s", config.host, config.port, config.policy)
    server = _Server(uv_config)
    server.run()
    return 0 if server.started else 1


def main(argv: list[str]) -> int:
    config = parse_router_args(argv)
    level = "DEBUG" if config.log_level == "trace" else config.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s [router] %(message)s")
    return serve(config)
