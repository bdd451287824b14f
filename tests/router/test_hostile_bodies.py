"""One client's body cannot stall the router for everyone else (issue #34, item 2): a body over
the limit gets 413 before the router reads it (declared) or as soon as it passes the limit
(streamed), and a long prompt is parsed and tokenized off the router's event loop. Measured on a
real `baton router` process in front of stand-in workers: the inter-event gaps of a steady
stream that runs meanwhile, and the router's resident memory."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from tests.router.fake_worker import FakeWorker
from tests.router.router_process import RouterProcess, start_router

EVERY_S = 0.02  # the steady stream: one event per 20 ms
MB = 1 << 20


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class SteadyStream:
    """A stream through the router, in a thread, that records when each event arrives."""

    def __init__(self, url: str, events: int) -> None:
        self.url, self.events, self.arrived = url, events, list[float]()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"model": "m", "prompt": "steady", "stream": True,
                "fake": {"decode": {"chunks": self.events, "every_s": EVERY_S}}}
        with httpx.Client(timeout=60, trust_env=False) as http, \
                http.stream("POST", f"{self.url}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.arrived.append(time.monotonic())

    def started(self) -> bool:
        return len(self.arrived) >= 5

    def max_gap(self) -> float:
        self.thread.join(60)
        assert len(self.arrived) == self.events, len(self.arrived)
        return max(b - a for a, b in zip(self.arrived, self.arrived[1:], strict=False))


def _until(check: Callable[[], bool], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _router(workers: Callable[..., FakeWorker], tmp_path: Path, *flags: str) -> RouterProcess:
    p, d = workers("prefill"), workers("decode")
    return start_router("--prefill", p.arg, "--decode", d.url, *flags,
                        log_path=tmp_path / "router.log")


def test_a_body_over_the_limit_is_refused_before_it_is_read(
        workers: Callable[..., FakeWorker], tmp_path: Path) -> None:
    router = _router(workers, tmp_path)  # the default limit: 1 MiB, as the workers'
    try:
        before = rss_mb(router.proc.pid)
        stream = SteadyStream(router.url, 150)  # 3 s
        _until(stream.started, "the steady stream never started")
        big = json.dumps({"model": "m", "prompt": "x" * (50 * MB)}).encode()
        with httpx.Client(timeout=30, trust_env=False) as http:
            began = time.monotonic()
            r = http.post(f"{router.url}/v1/completions", content=big,
                          headers={"content-type": "application/json"})
            took = time.monotonic() - began
            assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
            assert took < 1.0, f"413 after {took:.2f} s"

            def chunked() -> Iterator[bytes]:  # no Content-Length: the limit as it streams in
                for i in range(0, len(big), MB):
                    yield big[i:i + MB]

            began = time.monotonic()
            try:
                r = http.post(f"{router.url}/generate", content=chunked(),
                              headers={"content-type": "application/json"})
                assert r.status_code == 413, r.text
            except httpx.TransportError:  # refused mid-upload: the router closed the connection
                pass
            assert time.monotonic() - began < 2.0
        gap = stream.max_gap()
        assert gap < 1.0, f"the stream stalled {gap:.2f} s"
        assert rss_mb(router.proc.pid) - before < 100, (before, rss_mb(router.proc.pid))
    finally:
        assert router.stop() == 0, router.log()


def test_a_long_prompt_is_tokenized_off_the_event_loop(
        workers: Callable[..., FakeWorker], tmp_path: Path, tiny_path: Path) -> None:
    """cache_aware tokenizes text prompts: 4 MB of text takes the router's tokenizer seconds,
    which on the event loop every other stream waited out."""
    router = _router(workers, tmp_path, "--policy", "cache_aware", "--tokenizer", str(tiny_path),
                     "--max-body-bytes", str(8 * MB))
    try:
        with httpx.Client(timeout=60, trust_env=False) as http:  # the tokenizer loaded
            assert http.post(f"{router.url}/v1/completions",
                             json={"model": "m", "prompt": "warm up"}).status_code == 200
            stream = SteadyStream(router.url, 400)  # 8 s, past the tokenizing
            _until(stream.started, "the steady stream never started")
            long = "The quick brown fox jumps over the lazy dog. " * 90_000  # 4 MB
            began = time.monotonic()
            r = http.post(f"{router.url}/v1/completions", json={"model": "m", "prompt": long})
            assert r.status_code == 200, r.text
            print(f"4 MB prompt routed in {time.monotonic() - began:.2f} s")
        gap = stream.max_gap()
        print(f"the steady stream's longest gap meanwhile: {gap:.3f} s")
        assert gap < 1.0, f"the stream stalled {gap:.2f} s while the prompt was tokenized"
    finally:
        assert router.stop() == 0, router.log()
