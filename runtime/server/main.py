"""`baton serve`: the HTTP process (uvicorn + FastAPI) and one scheduler process (spawn).

Start-up: spawn the scheduler (it loads the model and runs a warm-up forward), load the tokenizer,
start uvicorn; `/ready` turns 200 when the scheduler reports ready. SIGTERM/SIGINT: drain
(runtime/server/drain.py: new requests and /ready get 503, in-flight ones get
`--shutdown-grace-s`, then end with the abort finish), then uvicorn stops and the scheduler frees
its KV and exits; the process exits 0 (1 if the scheduler died). A checkpoint or split it can
never serve exits 2 before anything starts, its reason logged and written to the container's
termination message (runtime/termination.py). IPC sockets live in a directory named after our
pid; one left by a killed server is removed at the next start.
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

from runtime.auth.api_keys import ApiKeys
from runtime.auth.key import load_cluster_key
from runtime.auth.ticket import TicketGate
from runtime.config import ServerArgs
from runtime.lifecycle import make_ipc_dir
from runtime.model_config import UnsupportedQuantization
from runtime.models.parallel import TPConfigError
from runtime.models.registry import UnsupportedArchitecture, check_architecture
from runtime.server.args import parse_server_args
from runtime.server.drain import begin_drain
from runtime.server.metrics import Metrics
from runtime.server.tokenizer_manager import TokenizerManager
from runtime.termination import EXIT_REFUSED, write_termination_message

log = logging.getLogger("baton.server")

SHUTDOWN_WRITE_S = 5


class _Server(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains (runtime.server.drain) with the
    listener still open, so `/ready` answers 503 meanwhile, and only then shuts uvicorn down; a
    second signal shuts it down without waiting for the drain. A signal handled so ends in exit
    code 0 (uvicorn re-raises it after shutting down)."""

    begin_drain: Callable[[], bool] | None = None  # True: draining, it ends with should_exit
    draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.draining and not self.should_exit and self.begin_drain is not None:
            self.draining = self.begin_drain()
            if self.draining:
                log.info("signal %d: draining in-flight requests (grace period)", sig)
                return
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


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
    from runtime.model_store import resolve_model_path
    from runtime.server.app import create_app
    from runtime.tokenizer import load_tokenizer

    model_path = resolve_model_path(args.model)
    # before anything starts: a clear error (the supported list; the counts TP cannot split)
    check_architecture(model_path, args.engine.tp)
    key = load_cluster_key(args.disagg.cluster_key_file)  # (the scheduler process reads its own)
    tm = TokenizerManager(args, None, ipc_dir, Metrics(), TicketGate(key, args.role))
    log.info("starting the scheduler process (model %s)", model_path)
    proc = _spawn_scheduler(args, tm)  # loads the model while this process loads the tokenizer
    tm.tokenizer = load_tokenizer(model_path)
    tm.model_path = str(model_path)
    config = uvicorn.Config(
        app="runtime.server.main:_unused",  # replaced below; uvicorn needs an app reference
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # uvicorn shuts down once the drain has ended every request: the handlers only have
        # their last bytes to write (a backstop, or the wait after a second signal)
        timeout_graceful_shutdown=SHUTDOWN_WRITE_S,
        access_log=False,
    )
    server = _Server(config)

    def request_exit() -> None:
        server.should_exit = True

    server.begin_drain = lambda: begin_drain(tm, args.shutdown_grace_s, request_exit)

    keys = ApiKeys.load(args.api_key, args.api_key_file, admin=args.admin_api_key)
    app = create_app(args, tm, proc, request_exit, keys)
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
    except (UnsupportedArchitecture, UnsupportedQuantization, TPConfigError) as e:
        log.error("%s", e)  # and where Kubernetes shows it (the operator's ModelNotServable)
        write_termination_message(str(e))
        return EXIT_REFUSED
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)
