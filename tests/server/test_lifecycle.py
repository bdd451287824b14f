"""Process life cycle: bad flags exit 2 before anything starts; SIGTERM drains and exits 0;
SIGKILL of the HTTP process under load leaves no process behind and its IPC directory goes at
the next start (issue 12, item 3; the tiny random model)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.server_process import BATON, REPO, ServerProcess, free_port, start_server


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


def _wait(predicate: Any, timeout: float, what: str, srv: ServerProcess) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{srv.log()}"
        time.sleep(0.05)


def test_sigterm_aborts_in_flight_after_grace_and_exits_zero(tmp_path: Path) -> None:
    srv = start_server("--shutdown-grace-s", "2", log_path=tmp_path / "server.log")
    chunks: list[dict] = []  # type: ignore[type-arg]
    first = threading.Event()

    def stream() -> None:
        body = {"text": "Count to one thousand:", "stream": True,
                "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}}
        with httpx.Client(base_url=srv.url, timeout=120) as c, c.stream("POST", "/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    first.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert first.wait(60), srv.log()
    began = time.monotonic()
    srv.terminate()
    time.sleep(0.5)
    with pytest.raises(httpx.HTTPError):  # no longer accepting
        httpx.post(f"{srv.url}/generate", json={"text": "hi"}, timeout=5).raise_for_status()
    code = srv.stop(timeout=60)
    t.join(30)
    assert code == 0, srv.log()
    assert time.monotonic() - began < 40
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort", chunks[-1]
    assert sum(len(c["output_ids"]) for c in chunks) < 3000


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


def test_sigkill_of_the_http_process_under_load_leaves_nothing(
        tiny_path: Path, tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"  # the servers' temp dir: their IPC directories are made here
    tmp.mkdir()
    env = {"TMPDIR": str(tmp)}
    srv = start_server("--served-model-name", "tiny", model=str(tiny_path), env=env,
                       log_path=tmp_path / "killed.log")
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
