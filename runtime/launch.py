"""`baton up`: a local disaggregated deployment — router + prefill and decode pools as processes.

    baton up [--model M] [--prefill N] [--decode M] [--prefill-tp N] [--decode-tp M] [--port 8000]
             [--kv-transfer nixl|tcp]
             [--host 127.0.0.1] [--log-dir DIR] [-- extra `baton serve` flags]

Every worker runs `baton serve --role prefill|decode` on a free port (prefill also on a free
bootstrap port), the router `baton router` on --port. It waits for every `/ready` (the router's
once it has seen every worker ready, so that a request it gets from then on may go to any of
them) and shows progress, prints the URL and a curl example. A child that dies while serving is started again
on its ports after a backoff (1 s, doubling to 30 s; reset once it has served a minute), and
the router finds it again; the rest keep serving. Ctrl-C / SIGTERM stops the router first, then
the workers, each with a SIGTERM to the process itself (it drains, then ends its scheduler),
and only what is left after the grace period is killed, process group and all. Each child also
dies with this process if it is killed (parent-death signal). Logs go to --log-dir.

The workers share this machine's cores, each with a thread per core, so their OpenMP threads
sleep at once when they wait (`sharing_cores`: GOMP_SPINCOUNT=0, unless OMP_WAIT_POLICY or
GOMP_SPINCOUNT is set): spinning threads of one process take the cores another computes on
(measured on two cores: TTFT p50 2.5 s instead of 0.36 s for 4 concurrent cached prompts;
docs/performance.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

import httpx

from runtime.auth.api_keys import ADMIN_ENV
from runtime.auth.api_keys import ENV as API_KEY_ENV
from runtime.auth.key import ENV as KEY_ENV
from runtime.errors import error_message
from runtime.lifecycle import die_with_parent
from runtime.router.config import POLICIES

READY_TIMEOUT_S = 900.0
STOP_GRACE_S = 20.0
RESTART_BACKOFF_S = (1.0, 30.0)  # the first wait before a restart, and the longest
HEALTHY_AFTER_S = 60.0  # a child that served this long starts its backoff afresh


@dataclass
class Child:
    name: str
    cmd: list[str]
    url: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)  # its own, on top of the deployment's
    ready_after: float | None = None
    not_ready: str = "no answer yet"  # what its last GET /ready said
    extra: dict[str, int] = field(default_factory=dict)
    ready_workers: dict[str, int] | None = None  # the router: ready once it sees these ready
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 0.0  # the wait before its next restart (0: none yet)
    restart_at: float | None = None  # when it is due to start again after dying

    def start(self, env: dict[str, str]) -> None:
        if self.log is None:
            self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**env, **self.env},
                                     start_new_session=True, preexec_fn=die_with_parent)

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


def free_ports(host: str, n: int) -> list[int]:
    """`n` distinct free ports, all held while they are picked (one pick at a time could give
    the same port twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="baton up", description=__doc__.split("\n\n")[0],
                                epilog="flags after `--` go to every `baton serve`")
    p.add_argument("--model", default="builtin:smollm2-135m", help="HF folder or builtin:NAME")
    p.add_argument("--prefill", type=int, default=1, help="prefill servers (default: 1)")
    p.add_argument("--decode", type=int, default=1, help="decode servers (default: 1)")
    p.add_argument("--prefill-tp", type=int, default=1, metavar="N",
                   help="tensor parallelism of each prefill server (default: 1)")
    p.add_argument("--decode-tp", type=int, default=1, metavar="N",
                   help="tensor parallelism of each decode server (default: 1; any TP pairs "
                   "with any other)")
    p.add_argument("--host", default="127.0.0.1", help="where everything listens")
    p.add_argument("--port", type=int, default=8000, help="the router's port (default: 8000)")
    p.add_argument("--kv-transfer", choices=["nixl", "tcp"], default="nixl")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware",
                   help="the router's (default: cache_aware, with the model's tokenizer)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="the router and every worker require `Authorization: Bearer KEY` (else "
                   "also $BATON_API_KEY); the router presents it to the workers; it is the "
                   "admin key too (the /debug/ views)")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="one log file per process (default: a new folder under the temp dir)")
    return p


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prefill < 1 or args.decode < 1:
        parser.error("--prefill and --decode must be >= 1")
    if args.prefill_tp < 1 or args.decode_tp < 1:
        parser.error("--prefill-tp and --decode-tp must be >= 1")
    if not 0 < args.port < 65536:
        parser.error("--port must be in 1..65535")
    return args, extra


def plan(args: argparse.Namespace, extra: list[str], log_dir: Path) -> list[Child]:
    """The worker and router commands, ports chosen; the router comes last."""
    baton = [sys.executable, "-m", "runtime.cli"]
    common = ["--model", args.model, "--host", args.host, "--kv-transfer", args.kv_transfer, *extra]
    children = []
    ports = iter(free_ports(args.host, 2 * (args.prefill + args.decode)))
    # the API key travels in the environment, never on a command line `ps` shows: the router
    # requires it of clients, and the workers of anyone who reaches their ports directly (the
    # router presents it to them)
    # (one key, one operator: it is also the admin key that reads the /debug/ views)
    key = {API_KEY_ENV: args.api_key, ADMIN_ENV: args.api_key} \
        if getattr(args, "api_key", None) else {}
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        tp = getattr(args, f"{role}_tp", 1)
        for i in range(count):
            port = next(ports)
            cmd = [*baton, "serve", "--role", role, "--port", str(port), *common]
            if tp > 1:
                cmd += ["--tp", str(tp)]
            child = Child(f"{role}-{i}", cmd, f"http://{args.host}:{port}", log_dir / f"{role}-{i}.log",
                          env=dict(key))
            if role == "prefill":
                child.extra["bootstrap_port"] = next(ports)
                child.cmd += ["--bootstrap-port", str(child.extra["bootstrap_port"])]
            else:  # a decode that drains hands its streams' KV to another (runtime/disagg/move.py)
                # on any free port: the decode names it to the router when it moves a stream
                # (with several ranks each listens on a free port of its own)
                kv_port = next(ports) if tp == 1 else 0
                child.cmd += ["--kv-port", str(kv_port), "--move-kv-on-drain",
                              "--bootstrap-port", "0"]
            children.append(child)
    router = [*baton, "router", "--host", args.host, "--port", str(args.port), "--policy", args.policy,
              "--tokenizer", args.model]
    for c in children:
        flag = "--prefill" if c.name.startswith("prefill") else "--decode"
        value = f"{c.url},{c.extra['bootstrap_port']}" if "bootstrap_port" in c.extra else c.url
        router += [flag, value]
    children.append(Child("router", router, f"http://{args.host}:{args.port}",
                          log_dir / "router.log", env=dict(key),
                          ready_workers={"prefill": args.prefill, "decode": args.decode}))
    return children


def sharing_cores(env: dict[str, str]) -> dict[str, str]:
    """`env` for a worker that shares its cores with other workers: its OpenMP threads sleep
    when they wait instead of spinning (unless `env` already says how they wait). Alone on its
    cores a worker is faster spinning (measured: docs/performance.md)."""
    if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(env):
        env["GOMP_SPINCOUNT"] = "0"
    return env


def children_env(base: Mapping[str, str], key: str | None) -> dict[str, str]:
    """`base` for every child, with cluster key `key` (None: none, as a bare `baton serve`)."""
    env = sharing_cores(dict(base, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false"))
    env.pop(KEY_ENV, None)
    if key is not None:
        env[KEY_ENV] = key
    return env


class Deployment:
    """The children, started together and stopped together."""

    def __init__(self, children: list[Child]) -> None:
        self.children = children
        self.stopping = False
        self.env: dict[str, str] = {}

    def start(self, key: str | None) -> None:
        """Start every child, with cluster key `key` (None: none, as a bare `baton serve`)."""
        self.env = env = children_env(os.environ, key)
        for child in self.children:
            child.start(env)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Poll every /ready; print each child as it gets ready. Raises if one exits or time
        runs out (the caller stops the rest)."""
        began = time.monotonic()
        with httpx.Client(timeout=2) as http:
            while not all(c.ready_after is not None for c in self.children):
                if self.stopping:
                    raise KeyboardInterrupt
                for child in self.children:
                    self._check(http, child, time.monotonic() - began)
                if time.monotonic() - began > timeout:
                    late = [f"{c.name} ({c.not_ready})" for c in self.children
                            if c.ready_after is None]
                    raise TimeoutError(f"not ready after {timeout:.0f} s: {'; '.join(late)}")
                time.sleep(0.5)

    def _check(self, http: httpx.Client, child: Child, waited: float) -> None:
        if child.ready_after is not None:
            return
        code = child.exited()
        if code is not None:
            raise RuntimeError(f"{child.name} exited with code {code}; its log "
                               f"({child.log_path}) ends:\n{child.tail()}")
        try:
            answer = http.get(f"{child.url}/ready")
            ready = answer.status_code == 200
            child.not_ready = error_message(answer)
            if ready and child.ready_workers is not None:
                seen = answer.json().get("ready_workers")
                ready = seen == child.ready_workers
                child.not_ready = f"it sees {seen} of {child.ready_workers} workers ready"
        except httpx.HTTPError as e:
            ready, child.not_ready = False, f"{type(e).__name__}: {e}"
        if ready:
            child.ready_after = waited
            done = sum(c.ready_after is not None for c in self.children)
            print(f"  [{done}/{len(self.children)}] {child.name} ready at {child.url} "
                  f"({waited:.1f} s)", flush=True)

    def watch(self) -> int:
        """Serve until a signal, starting again each child that dies; returns the exit code."""
        while not self.stopping:
            for child in self.children:
                self._tend(child, time.monotonic())
            time.sleep(0.5)
        return 0

    def _tend(self, child: Child, now: float) -> None:
        """A child that exited is due to start again after its backoff, on its own ports."""
        if child.restart_at is not None:
            if now >= child.restart_at:
                child.restart_at = None
                child.restarts += 1
                print(f"baton up: starting {child.name} again (restart {child.restarts})",
                      flush=True)
                child.start(self.env)
            return
        code = child.exited()
        if code is None:
            return
        _signal(child, signal.SIGKILL)  # what it left behind (its scheduler) goes too
        first, longest = RESTART_BACKOFF_S
        served = now - child.started_at
        child.backoff_s = first if served >= HEALTHY_AFTER_S or not child.backoff_s else min(
            longest, 2 * child.backoff_s)
        child.restart_at = now + child.backoff_s
        print(f"baton up: {child.name} exited with code {code} after {served:.0f} s; starting it "
              f"again in {child.backoff_s:.0f} s (the others keep serving). Its log ends:\n"
              f"{child.tail()}", file=sys.stderr, flush=True)

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """The router first, then the workers: SIGTERM to each process itself (it drains and
        ends its own children), then, after `grace`, SIGKILL to what is left of its group."""
        router, workers = self.children[-1:], self.children[:-1]
        for group in (router, workers):
            for child in group:
                if child.proc is not None and child.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for child in group:
                _wait_or_kill(child, deadline)
        for child in self.children:
            if child.log is not None:
                child.log.close()


def _wait_or_kill(child: Child, deadline: float) -> None:
    if child.proc is None:
        return
    try:
        child.proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        print(f"baton up: {child.name} still running after the grace period; killing it",
              file=sys.stderr, flush=True)
    _signal(child, signal.SIGKILL)  # its group: a scheduler its server left behind too
    child.proc.wait(5)


def _signal(child: Child, sig: int) -> None:
    """`sig` to the child's whole process group (the child may have exited already)."""
    if child.proc is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.proc.pid, sig)


def banner(url: str, model: str, log_dir: Path, keyed: bool = False) -> str:
    model = model.removeprefix("builtin:")  # the name the workers serve it as
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 32})
    return (f"\nbaton is up: {url}  (OpenAI API under /v1; logs in {log_dir})\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            + ("       -H 'Authorization: Bearer <your --api-key>' \\\n" if keyed else "") +
            f"       -d '{body}'\n"
            "Ctrl-C stops everything.\n")


def main(argv: list[str]) -> int:
    args, extra = parse(argv)
    log_dir = args.log_dir or Path(_mkdtemp())
    log_dir.mkdir(parents=True, exist_ok=True)
    deployment = Deployment(plan(args, extra, log_dir))

    def on_signal(sig: int, frame: FrameType | None) -> None:
        deployment.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"baton up: {args.prefill} prefill (tp {args.prefill_tp}) + {args.decode} decode "
          f"(tp {args.decode_tp}) + router, model "
          f"{args.model}, KV transfer {args.kv_transfer}; logs in {log_dir}", flush=True)
    try:
        # one cluster key for the router and workers (yours if $BATON_CLUSTER_KEY is set): room
        # tickets, bootstrap calls and KV links are authenticated, as in a cluster
        deployment.start(os.environ.get(KEY_ENV) or secrets.token_hex(32))
        deployment.wait_ready()
        print(banner(deployment.children[-1].url, args.model, log_dir, bool(args.api_key)),
              flush=True)
        return deployment.watch()
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"baton up: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("baton up: stopping", flush=True)
        deployment.stop()


def _mkdtemp() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="baton-up-")
