"""A broken P<->D link with real processes (docs/router.md "Health per (prefill, decode) pair"):
2 prefills and 2 decodes, the KV link from prefill 0 to decode 0 broken by a fault plugin
(tests/disagg/broken_link.py). Every request is still answered, token-exact; the pair is
quarantined while both of its workers keep serving with their other partners; once the link is
mended, the pair's probe succeeds and it is healthy again."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from tests.disagg.test_pd_failures import eventually, kv_free, metric
from tests.disagg.test_pd_retry import ask_all, deploy


def pair(router: str, p: str, d: str) -> dict[str, Any]:
    pairs = httpx.get(f"{router}/debug/pairs").json()["pairs"]
    return next((x for x in pairs if (x["prefill"], x["decode"]) == (p, d)), {})


def served(url: str) -> float:
    """Requests the worker finished well (each ends with finish reason length here; a prefill's
    once its KV went out)."""
    return metric(url, 'baton_requests_total{status="length"}')


def test_a_broken_link_quarantines_its_pair_and_heals(sharp_tiny_path: Path,
                                                      tmp_path: Path) -> None:
    flag = tmp_path / "broken-link"
    dep = deploy(sharp_tiny_path, tmp_path, 2, 2, ("--plugin", "tests.disagg.broken_link"),
                 router_args=("--pair-quarantine-s", "1", "--pair-max-quarantine-s", "2"),
                 prefill_env=[{"BATON_TEST_BROKEN_LINK": str(flag)}, {}])
    try:
        router, (p0, p1), (d0, d1) = dep.router.url, dep.prefills, dep.decodes
        healthy = asyncio.run(ask_all(router, 16))
        kv_port = dep.decodes[0].proc.args[dep.decodes[0].proc.args.index("--kv-port") + 1]
        flag.write_text(str(kv_port))  # P0 -> D0 breaks
        before = {w.url: served(w.url) for w in (p0, d0)}
        assert asyncio.run(ask_all(router, 16)) == healthy
        broken = pair(router, p0.url, d0.url)
        assert broken["state"] in ("quarantined", "probing") and broken["failed"] >= 2, broken
        assert "broken" in broken["last_error"]
        for w in (p0, d0):  # each still serves with its other partner
            assert served(w.url) > before[w.url], w.url
        assert pair(router, p0.url, d1.url)["failed"] == 0
        assert pair(router, p1.url, d0.url)["failed"] == 0

        flag.unlink()  # mended: after its quarantine a probe finds the pair working
        deadline = time.monotonic() + 30
        while pair(router, p0.url, d0.url)["state"] != "healthy":
            assert time.monotonic() < deadline, pair(router, p0.url, d0.url)
            assert asyncio.run(ask_all(router, 4)) == healthy[:4]
        assert pair(router, p0.url, d0.url)["failures_in_a_row"] == 0
        eventually(lambda: all(kv_free(w.url) for w in (p0, p1, d0, d1)))
    finally:
        dep.stop()
