"""Issue 12: the router rejects what `baton serve` rejects, the same way (status, code, param,
message), before any worker sees the request — it checks with the workers' own request models.
Each bad body goes to both front doors: the session's real `baton serve` and one router."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given

from tests.router.conftest import RouterThread, stop_all, wait_for
from tests.router.fake_worker import FakeWorker
from tests.server import hostile_cases as hc
from tests.server.hostile_cases import HOSTILE_SETTINGS, check_hostile, hostile_bodies
from tests.server.test_errors import CASES as ERROR_CASES

PD = tuple[RouterThread, FakeWorker, FakeWorker]
# The router's own checks are the ones that need no model: not its name, vocabulary or context.
HOSTILE = [c for c in hc.ALL if c.router]
WORKER_ONLY = {"unknown-model", "prompt-too-long", "too-many-new-tokens", "kv-pool-too-small",
               "token-out-of-vocab"}
SCHEMA = [c for c in ERROR_CASES if c[0] not in WORKER_ONLY]


@pytest.fixture(scope="module")
def shared_pd() -> Iterator[PD]:
    """One router over one prefill and one decode stand-in for the whole table (a router per
    case would cost ~0.5 s each); each test starts with empty records."""
    p, d = FakeWorker("prefill").start(), FakeWorker("decode").start()
    router = RouterThread(["--prefill", p.arg, "--decode", d.arg]).wait_ready()
    yield router, p, d
    router.client.close()
    stop_all([router.server, p.server, d.server])


@pytest.fixture
def pd(shared_pd: PD) -> PD:
    for worker in shared_pd[1:]:
        worker.received.clear()
        worker.aborts.clear()
    return shared_pd


def _answer(client: httpx.Client, path: str, body: bytes,
            headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    r = client.post(path, content=body, headers=headers)
    return r.status_code, r.json().get("error", {})


def _same(router: RouterThread, server: httpx.Client, path: str, body: bytes,
          headers: dict[str, str]) -> dict[str, Any]:
    got, error = _answer(router.client, path, body, headers)
    want, expected = _answer(server, path, body, headers)
    assert got == want and 400 <= got < 500, (got, want, error, expected)
    assert {k: error[k] for k in ("code", "param")} == {k: expected[k] for k in ("code", "param")}
    assert error["message"] == expected["message"]
    return error


@pytest.mark.parametrize("case", HOSTILE, ids=hc.ids(HOSTILE))
def test_hostile_bodies_get_the_servers_answer_and_reach_no_worker(
        pd: PD, client: httpx.Client, case: hc.Case) -> None:
    router, p, d = pd
    error = _same(router, client, case.path, case.body, case.headers)
    assert error["param"] == case.param and case.needle.lower() in error["message"].lower()
    assert not p.received and not d.received and not p.aborts


@pytest.mark.parametrize(("name", "path", "body", "status", "needle"), SCHEMA,
                         ids=[c[0] for c in SCHEMA])
def test_schema_errors_match_the_server(pd: PD, client: httpx.Client, name: str, path: str,
                                        body: object, status: int, needle: str) -> None:
    router, p, d = pd
    raw = body if isinstance(body, bytes) else hc.raw(body)
    error = _same(router, client, path, raw, hc.JSON_HEADERS)
    assert needle.lower() in error["message"].lower()
    assert not p.received and not d.received


def test_what_needs_the_model_reaches_the_workers(pd: PD) -> None:
    router, p, d = pd
    passed = [c for c in hc.ALL if not c.router]
    for case in passed:
        r = router.client.post(case.path, content=case.body, headers=case.headers)
        assert r.status_code == 200, r.text  # the stand-ins accept anything
    assert len(d.received) == len(passed)
    # the client has D's answer; P's call was sent alongside and may still be on its way
    wait_for(lambda: len(p.received) == len(passed), what="every prefill call")


def test_fuzzed_hostile_values_get_the_servers_answer(pd: PD, client: httpx.Client) -> None:
    """The server's fuzz of surrogates and non-finite numbers anywhere, through both doors."""
    router, p, d = pd

    @HOSTILE_SETTINGS
    @given(case=hostile_bodies())
    def run(case: tuple[str, bytes, str, str]) -> None:
        path, raw, param, needle = case
        check_hostile(router.client, path, raw, param, needle)
        _same(router, client, path, raw, hc.JSON_HEADERS)

    run()
    assert not p.received and not d.received and not p.aborts
