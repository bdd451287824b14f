"""DNS discovery: every address a name resolves to is a worker; they join and leave with it.

The resolver is injected (a dict of names to loopback addresses), so nothing leaves the
machine; workers listen on 127.0.0.1 and 127.0.0.2 with the same port, as pods behind a
headless Service do.
"""

from __future__ import annotations

from typing import Any

from runtime.router.discovery import address_url
from runtime.router.workers import Worker
from tests.ports import free_port
from tests.router.conftest import RouterThread, wait_for
from tests.router.server_thread import free_port_on

PREFILL, DECODE = "prefill.pool.test", "decode.pool.test"


class Records:
    """A fake DNS zone the test edits while the router runs."""

    def __init__(self, **names: list[str]) -> None:
        self.names = names
        self.lookups = 0

    async def resolve(self, host: str, port: int) -> list[str]:
        self.lookups += 1
        if host not in self.names:
            raise OSError(f"[Errno -2] Name or service not known: {host}")
        return [ip for ip in self.names[host] for _ in range(2)]  # duplicates, like getaddrinfo


def ready_counts(router: RouterThread) -> dict[str, int]:
    return router.client.get("/ready").json()["ready_workers"]  # type: ignore[no-any-return]


def test_dns_workers_join_and_leave_as_records_change(workers: Any) -> None:
    pport, dport = free_port_on(["127.0.0.1", "127.0.0.2"]), free_port()
    p1 = workers("prefill", host="127.0.0.1", port=pport)
    p2 = workers("prefill", host="127.0.0.2", port=pport)
    workers("decode", port=dport)
    zone = Records(**{PREFILL: ["127.0.0.1"], DECODE: ["127.0.0.1"]})
    router = RouterThread(["--prefill-dns", f"{PREFILL}:{pport}:9000",
                           "--decode-dns", f"{DECODE}:{dport}"], resolver=zone.resolve)
    try:
        router.wait_ready()
        assert router.client.post("/generate", json={"text": "x", "rid": "one"}).status_code == 200
        sent = p1.generation("one").body
        assert (sent["bootstrap_host"], sent["bootstrap_port"]) == ("127.0.0.1", 9000)

        zone.names[PREFILL] = ["127.0.0.1", "127.0.0.2"]  # a pod joins
        wait_for(lambda: ready_counts(router)["prefill"] == 2, what="the new prefill")
        for i in range(2):
            router.client.post("/generate", json={"text": "x", "rid": f"both{i}"})
        # the client has the decode's answer; the prefill's call may still be on its way
        wait_for(lambda: all(p1.got(r) or p2.got(r) for r in ("both0", "both1")),
                 what="both prefill calls")
        assert {p1.got("both0"), p1.got("both1")} == {True, False}
        assert p2.generation().body["bootstrap_host"] == "127.0.0.2"

        zone.names[PREFILL] = ["127.0.0.2"]  # a pod leaves
        wait_for(lambda: ready_counts(router)["prefill"] == 1, what="the prefill to leave")
        for i in range(3):
            router.client.post("/generate", json={"text": "x", "rid": f"left{i}"})
            p2.generation(f"left{i}")  # waits for it
            assert not p1.got(f"left{i}")

        del zone.names[PREFILL]  # resolution fails: the known workers stay
        seen = zone.lookups
        wait_for(lambda: zone.lookups > seen + 2, what="more lookups")
        assert ready_counts(router)["prefill"] == 1

        zone.names[PREFILL] = []  # no records: no prefill workers
        wait_for(lambda: router.client.get("/ready").status_code == 503, what="/ready 503")
        error = router.client.get("/ready").json()["error"]["message"]
        assert "no ready prefill" in error and "no ready decode" not in error
    finally:
        router.stop()


def test_static_and_dns_roles_mix(workers: Any) -> None:
    p, d = workers("prefill"), workers("decode")
    zone = Records(**{DECODE: ["127.0.0.1"]})
    router = RouterThread(["--prefill", p.arg, "--decode-dns", f"{DECODE}:{d.server.port}"],
                          resolver=zone.resolve)
    try:
        router.wait_ready()
        assert router.client.post("/generate", json={"text": "x"}).status_code == 200
    finally:
        router.stop()


def test_addresses_become_urls_and_back() -> None:
    assert address_url("10.0.0.7", 8000) == "http://10.0.0.7:8000"
    assert address_url("fd00::7", 8000) == "http://[fd00::7]:8000"
    assert Worker("prefill", "http://[fd00::7]:8000").host == "fd00::7"
    assert Worker("prefill", "http://10.0.0.7:8000").host == "10.0.0.7"
    assert Worker("prefill", "http://llm-prefill-0.ns:8000").host == "llm-prefill-0.ns"
    assert Worker("prefill", "https://user@Worker.example").host == "Worker.example"
