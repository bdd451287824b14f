"""`baton serve`: the HTTP process (uvicorn + FastAPI) and one scheduler process (spawn).

Start-up: spawn the scheduler (it loads the model and runs a warm-up forward), load the tokenizer,
start uvicorn; `/ready` turns 200 when the scheduler reports ready. SIGTERM/SIGINT: uvicorn stops
accepting and gives in-flight requests `--shutdown-grace-s` to finish, then the scheduler aborts
whatever is left, frees its KV and exits; the process exits 0 (1 if the scheduler died).
IPC sockets live in a directory named after our pid; one left by a killed server is removed at
the next start.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from types import FrameType

import uvicorn

from runtime.config import ServerArgs
from runtime.lifecycle import make_ipc_dir
from runtime.server.args import parse_server_args
from runtime.server.metrics import Metrics
from runtime.server.tokenizer_manager import TokenizerManager

log = logging.getLogger("baton.server")


class _Server(uvicorn.Server):
    """uvicorn, except that a SIGTERM/SIGINT it handled gracefully ends in exit code 0 (uvicorn
    re-raises the signal after shutting down), and /ready turns 503 as soon as draining starts."""

    on_exit: Callable[[], None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            log.info("signal %d: draining in-flight requests (grace period)", sig)
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
        if self.on_exit is not None:
            self.on_exit()


def _spawn_scheduler(args: ServerArgs, tm: TokenizerManager) -> BaseProcess:
    from runtime.scheduler.process import run_scheduler_process

    proc = mp.get_context("spawn").Process(
        target=run_scheduler_process,
        args=(args, tm.to_scheduler, tm.from_scheduler, os.getpid()),
        name="baton-scheduler",
        daemon=True,
    )
    proc.start()
    return proc


def _serve(args: ServerArgs, ipc_dir: str) -> int:
    from runtime.engine.engine import load_tokenizer
    from runtime.models.prepare import resolve_model_path
    from runtime.server.app import create_app

    model_path = resolve_model_path(args.model)
    tm = TokenizerManager(args, None, ipc_dir, Metrics())
    log.info("starting the scheduler process (model %s)", model_path)
    proc = _spawn_scheduler(args, tm)  # loads the model while this process loads the tokenizer
    tm.tokenizer = load_tokenizer(model_path)
    config = uvicorn.Config(
        app="runtime.server.main:_unused",  # replaced below; uvicorn needs an app reference
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # after the grace period the TokenizerManager aborts what is left; this is a backstop
        timeout_graceful_shutdown=int(args.shutdown_grace_s) + 10,
        access_log=False,
    )
    server = _Server(config)
    server.on_exit = lambda: tm.stop_accepting(args.shutdown_grace_s)

    def request_exit() -> None:
        server.should_exit = True

    app = create_app(args, tm, proc, request_exit)
    config.app = app
    log.info("HTTP on http://%s:%d (ready once the model is warmed up)", args.host, args.port)
    server.run()
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    return 1 if app.state.failed else 0


def main(argv: list[str]) -> int:
    args = parse_server_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s [http] %(message)s"
    )
    ipc_dir = make_ipc_dir()
    try:
        return _serve(args, ipc_dir)
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)
