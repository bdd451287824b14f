"""Process life cycle: bad flags exit 2 before anything starts; SIGTERM under load drains and
exits 0, every client getting its finish (issue 12, item 4); SIGKILL of the HTTP process
leaves no process behind and its IPC directory goes at the next start (item 3).

Both load tests use the tiny random model; the SIGTERM one slows its prefill down with the
`slow-prefill` attention plugin (tests/server/slow_prefill.py), as a long prompt on a slow
device: one prompt chunk outlasts the grace period by far."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from runtime.server.drain import ABORT_WAIT_S
from tests.ports import free_port
from tests.server.server_process import BATON, REPO, ServerProcess, start_server


def test_unknown_role_is_rejected() -> None:
    r = subprocess.run([str(BATON), "serve", "--role", "router"], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    assert r.returncode == 2 and "--role" in r.stderr


def test_bad_flag_value_is_rejected() -> None:
    r = subprocess.run([str(BATON), "serve", "--stream-interval", "0"], capture_output=True,
                       text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2 and "--stream-interval" in r.stderr


def test_scheduler_failure_exits_nonzero_with_the_reason(tmp_path: Path) -> None:
    r = subprocess.run(
        [str(BATON), "serve", "--port", str(free_port()), "--sampler-backend", "no-such-sampler"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert r.returncode == 1
    assert "unknown sampler backend" in r.stderr and "scheduler process exited" in r.stderr


@dataclass
class Client:
    """One request read on a thread to its end: status, raw body, or the transport error."""

    path: str
    body: dict[str, Any]
    status: int | None = None
    text: str = ""
    error: str | None = None
    ended_at: float | None = None
    started: threading.Event = field(default_factory=threading.Event)

    def run(self, url: str) -> threading.Thread:
        thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        thread.start()
        return thread

    def _read(self, url: str) -> None:
        try:
            with httpx.Client(base_url=url, timeout=120) as c, c.stream(
                    "POST", self.path, json=self.body) as r:
                self.status = r.status_code
                for chunk in r.iter_text():
                    self.text += chunk
                    if "data: " in self.text:
                        self.started.set()
        except httpx.HTTPError as e:
            self.error = repr(e)
        finally:
            self.ended_at = time.monotonic()

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def finish_reasons(self) -> list[str]:
        """The finish reason(s) it got; asserts a whole answer (a stream ends in [DONE])."""
        assert self.error is None and self.status == 200, (self.status, self.error, self.text)
        if self.stream:
            lines = [ln[6:] for ln in self.text.splitlines() if ln.startswith("data: ")]
            assert lines and lines[-1] == "[DONE]", f"cut stream: {self.text[-300:]!r}"
            events = [json.loads(ln) for ln in lines[:-1]]
        else:
            events = [json.loads(self.text)]
        if self.path == "/generate":
            return [e["meta_info"]["finish_reason"]["type"] for e in events
                    if e["meta_info"]["finish_reason"]]
        return [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]


def _short(i: int) -> Client:
    """Seven kinds of long generations: both endpoints' shapes, streaming or not."""
    stream = i % 2 == 0
    sampling = {"temperature": 0, "ignore_eos": True}
    if i % 3 == 0:
        return Client("/generate", {"text": f"Request {i}:", "stream": stream, "sampling_params":
                                    {"max_new_tokens": 1500, **sampling}})
    if i % 3 == 1:
        return Client("/v1/completions", {"model": "tiny", "prompt": f"Request {i}:",
                                          "max_tokens": 1500, "stream": stream, **sampling})
    return Client("/v1/chat/completions", {"model": "tiny", "max_tokens": 1500, "stream": stream,
                                           "messages": [{"role": "user", "content": f"R{i}"}],
                                           **sampling})


def _inflight(srv: ServerProcess) -> int:
    return int(httpx.get(f"{srv.url}/debug/stats", timeout=10).json()["inflight"])


def _wait(predicate: Any, timeout: float, what: str, srv: ServerProcess) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{srv.log()}"
        time.sleep(0.05)


GRACE_S = 2.0
SLACK_S = 3.0  # scheduling noise on a loaded 2-core machine


def test_sigterm_during_a_long_prefill_ends_every_request_within_grace(
        tiny_path: Path, tmp_path: Path) -> None:
    mark = tmp_path / "long-prefill-started"
    srv = start_server(
        "--served-model-name", "tiny", "--shutdown-grace-s", str(GRACE_S),
        "--max-total-tokens", "32768", "--plugin", "tests.server.slow_prefill",
        "--attention-backend", "slow-prefill", model=str(tiny_path),
        log_path=tmp_path / "server.log", env={"BATON_TEST_PREFILL_MARK": str(mark)})
    clients = [_short(i) for i in range(7)]
    # a 2100-token prompt: its first 2048-token chunk takes ~10 s in the slowed-down backend
    clients.append(Client("/generate", {"input_ids": [1000 + i % 500 for i in range(2100)],
                                        "sampling_params": {"max_new_tokens": 16}}))
    threads = [c.run(srv.url) for c in clients[:7]]
    _wait(lambda: all(c.started.is_set() for c in clients[:7] if c.stream) and _inflight(srv) == 7,
          60, "the generations to start", srv)
    threads.append(clients[7].run(srv.url))
    _wait(mark.exists, 30, "the long prefill", srv)

    sigterm = time.monotonic()
    srv.terminate()
    time.sleep(0.3)
    # draining: the listener is open, /ready and new work answer 503 as JSON
    ready = httpx.get(f"{srv.url}/ready", timeout=5)
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready", ready.text
    late = httpx.post(f"{srv.url}/generate", json={"text": "hi"}, timeout=5)
    assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]

    deadline = sigterm + GRACE_S + ABORT_WAIT_S + SLACK_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    late_ones = [c.path for c in clients if c.ended_at is None or c.ended_at > deadline]
    assert not late_ones, f"still running {deadline - sigterm:.1f} s after SIGTERM: {late_ones}"
    for c in clients:
        assert c.finish_reasons() and set(c.finish_reasons()) == {"abort"}, (c.path, c.text[-300:])
    assert srv.stop(timeout=60) == 0, srv.log()


def _children(pid: int) -> set[int]:
    """Every live descendant of `pid`, from /proc."""
    parent_of: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parent_of[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent_of.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _ready_statuses(srv: ServerProcess) -> list[int]:
    """Poll /ready until it is 200; the statuses it answered (none while not listening)."""
    statuses: list[int] = []
    _wait(lambda: _probe(srv, statuses), 180, "/ready", srv)
    return statuses


def _probe(srv: ServerProcess, statuses: list[int]) -> bool:
    assert srv.proc.poll() is None, srv.log()
    try:
        statuses.append(httpx.get(f"{srv.url}/ready", timeout=2).status_code)
    except httpx.HTTPError:
        return False
    return statuses[-1] == 200


def test_sigkill_of_the_http_process_under_load_leaves_nothing(
        tiny_path: Path, tmp_path: Path) -> None:
    # the servers' temp dir, where their IPC directories are made: a short one (a deeper one
    # than a socket's path allows sends them to /tmp)
    tmp = Path(tempfile.mkdtemp(prefix="lifecycle-", dir="/tmp"))
    env = {"TMPDIR": str(tmp)}
    srv = ServerProcess("--served-model-name", "tiny", model=str(tiny_path), env=env,
                        log_path=tmp_path / "killed.log")
    probes = _ready_statuses(srv)
    # item 5 on the way: the probe's 503s while loading are answers, not errors
    assert probes[-1] == 200 and 503 in probes, probes
    assert 'baton_http_errors_total{status="503"}' not in httpx.get(f"{srv.url}/metrics").text
    clients = [Client("/generate", {"text": f"Request {i}:", "stream": True, "sampling_params": {
        "max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}) for i in range(8)]
    threads = [c.run(srv.url) for c in clients]
    _wait(lambda: all(c.started.is_set() for c in clients), 60, "the streams", srv)
    children = _children(srv.proc.pid)
    assert children, "no scheduler process"
    [ipc_dir] = list(tmp.glob("baton-ipc-*"))

    os.kill(srv.proc.pid, signal.SIGKILL)  # the HTTP process only
    srv.proc.wait(10)
    _wait(lambda: not any(_alive(p) for p in children), 10, f"{children} to exit", srv)
    for t in threads:
        t.join(10)
    assert all(c.error is not None for c in clients)  # cut, as the server is gone
    assert ipc_dir.exists()  # nobody was left to clean it ...

    again = start_server("--served-model-name", "tiny", model=str(tiny_path), env=env,
                         log_path=tmp_path / "next.log")
    try:
        assert not ipc_dir.exists(), "the next start left the stale IPC directory"
        assert len(list(tmp.glob("baton-ipc-*"))) == 1  # its own
    finally:
        assert again.stop() == 0, again.log()
    assert not list(tmp.glob("baton-ipc-*"))
    tmp.rmdir()
