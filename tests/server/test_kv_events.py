"""KV events: GET /kv_events gives a snapshot of the cached block hashes and then every block
stored or removed, numbered; a follower that replays them holds exactly the worker's cache."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from runtime.kvcache.radix import REMOVED, STORED, block_hashes
from runtime.server.kv_events import KVEventLog
from tests.router.conftest import wait_for
from tests.server.server_process import ServerProcess
from tests.server.test_concurrency import _wait_idle

PAGE = 16


class Follower:
    """Reads /kv_events on a thread and replays it: what a router's index does."""

    def __init__(self, url: str) -> None:
        self.events: list[dict[str, Any]] = []
        self.blocks: set[int] = set()
        self.seq = -1
        self.gaps = 0
        self.status = 0
        self.ended = threading.Event()
        self._client = httpx.Client(timeout=30)
        self.hung_up = False
        self._resp: httpx.Response | None = None
        self._thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self._thread.start()

    def _read(self, url: str) -> None:
        try:
            self._follow(url)
        except (httpx.HTTPError, OSError, ValueError):
            if not self.hung_up:  # the read our own hang-up broke off is no failure
                raise
        finally:
            self.ended.set()

    def _follow(self, url: str) -> None:
        with self._client.stream("GET", f"{url}/kv_events") as resp:
            self._resp = resp
            self.status = resp.status_code
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                self.events.append(event)
                if event["type"] == "snapshot":
                    self.blocks, self.seq = set(event["blocks"]), event["seq"]
                    continue
                if event["seq"] != self.seq + len(event["blocks"]):
                    self.gaps += 1
                self.seq = event["seq"]
                if event["type"] == "stored":
                    self.blocks |= set(event["blocks"])
                else:
                    self.blocks -= set(event["blocks"])

    def wait_for(self, check: Any, timeout: float = 10) -> None:
        wait_for(check, timeout, f"the follower (HTTP {self.status}, blocks {self.blocks})")

    def stop(self) -> None:
        """Hang up (closing the client ends the read the thread is blocked in)."""
        self.hung_up = True
        if self._resp is not None:  # closing the client leaves the thread's read blocked:
            stream = self._resp.extensions.get("network_stream")  # end it at the socket
            sock = stream.get_extra_info("socket") if stream is not None else None
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        self._client.close()
        self._thread.join(10)


def cached(client: httpx.Client) -> set[int]:
    return set(client.get("/debug/prefix_cache").json()["block_hashes"])


@pytest.fixture
def follow(server: ServerProcess) -> Iterator[Callable[[], Follower]]:
    """Followers of the server's /kv_events, hung up at the end whatever happened."""
    started: list[Follower] = []

    def start() -> Follower:
        started.append(Follower(server.url))
        return started[-1]

    yield start
    for follower in started:
        follower.stop()


def test_a_follower_tracks_the_cache_through_requests_and_a_flush(
        client: httpx.Client, follow: Callable[[], Follower]) -> None:
    _wait_idle(client)
    client.post("/flush_cache")
    follower = follow()
    follower.wait_for(lambda: follower.events)
    snapshot = follower.events[0]
    assert snapshot["type"] == "snapshot" and snapshot["page_size"] == PAGE
    assert snapshot["blocks"] == [] and snapshot["instance"]
    ids = list(range(2000, 2000 + 4 * PAGE + 3))
    out = client.post("/generate", json={"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": 3}}).json()
    computed = (ids + out["output_ids"])[:-1]
    want = set(block_hashes(computed, PAGE))
    follower.wait_for(lambda: follower.blocks == want)
    late = follow()  # joins now: its snapshot is the same truth
    late.wait_for(lambda: late.blocks == want)
    assert cached(client) == want
    client.post("/flush_cache")
    follower.wait_for(lambda: follower.blocks == set())
    late.wait_for(lambda: late.blocks == set())
    assert follower.gaps == 0 and late.gaps == 0
    kinds = [e["type"] for e in follower.events]
    assert kinds[0] == "snapshot" and "stored" in kinds and kinds[-1] == "removed"


def test_the_log_numbers_every_change_and_cuts_off_a_stalled_subscriber() -> None:
    async def scenario() -> None:
        log = KVEventLog(PAGE, "i-1")
        log.apply([[STORED, 1], [STORED, 2], [REMOVED, 1], [STORED, 3]])
        snapshot, sub = log.subscribe()
        assert snapshot == {"type": "snapshot", "seq": 4, "instance": "i-1", "page_size": PAGE,
                            "blocks": [2, 3]}
        log.apply([[REMOVED, 2], [REMOVED, 3], [STORED, 9]])
        got = [sub.queue.get_nowait() for _ in range(2)]
        assert got == [{"type": "removed", "seq": 6, "blocks": [2, 3]},
                       {"type": "stored", "seq": 7, "blocks": [9]}]
        for i in range(2000):  # nobody reads: the subscriber is cut off, not buffered forever
            log.apply([[STORED, 100 + i]])
        items = []
        while not sub.queue.empty():
            items.append(sub.queue.get_nowait())
        assert items[-1] is None and len(items) <= 1024
        assert log.snapshot()["seq"] == 7 + 2000

    asyncio.run(scenario())


def test_a_server_without_a_cache_says_so(tmp_path: Any) -> None:
    from tests.server.server_process import start_server

    srv = start_server("--disable-prefix-cache", log_path=tmp_path / "server.log")
    try:
        resp = httpx.get(f"{srv.url}/kv_events", timeout=10)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_kv_events"
        assert httpx.get(f"{srv.url}/debug/prefix_cache").json()["enabled"] is False
    finally:
        srv.stop()
