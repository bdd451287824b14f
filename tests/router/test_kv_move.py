"""A draining decode that moves a stream's KV away (runtime/disagg/move.py) ends its stream
with a "moved" hand-over event (runtime/handover.py): the router continues the stream on another
decode that fetches that KV from the draining one, with no prefill involved; when that fails,
or nothing can take it, the tokens are replayed on a fresh pair. A "drained" hand-over (the
grace period ended) is replayed. Either is a migration, never an upstream failure (docs/router.md
"Migration"). Stand-in workers over real HTTP; the real thing: tests/disagg/test_pd_move.py and
test_pd_retry.py."""

from __future__ import annotations

import secrets
from typing import Any

import pytest

from runtime.auth.key import ENV, load_cluster_key
from runtime.auth.ticket import verify
from tests.router.conftest import wait_for
from tests.router.test_proxy import BODIES, sse
from tests.router.test_retry import contents, metric

MOVE = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 9555, "bootstrap_room": 4242}


def moving_deployment(workers: Any, router: Any, *flags: str) -> tuple[Any, Any, list[Any]]:
    p = workers("prefill")
    ds = [workers("decode"), workers("decode")]
    r = router([p], ds, "--policy", "round_robin", *flags)
    ds[0].steer = {"move_after": 2, "move": MOVE}
    # the router is ready with one pair: a move needs the second decode ready too
    wait_for(lambda: metric(r, 'baton_router_ready_workers{role="decode"}') == 2,
             what="both decodes ready")
    return r, p, ds


@pytest.mark.parametrize("path", list(BODIES))
def test_a_moved_stream_goes_on_where_its_kv_went(workers: Any, router: Any, path: str) -> None:
    r, p, ds = moving_deployment(workers, router)
    body = {**BODIES[path], "stream": True, "fake": {"decode": {"chunks": 5}}}
    status, got = sse(r.client, path, body)
    assert status == 200 and got[-1] == "[DONE]"
    assert not any("error" in e for e in got[:-1]), got
    assert contents(path, got) == [f"tok{i} " for i in range(5)]  # each token once
    first, moved = ds[0].generation().body, ds[1].generation().body
    assert first["allow_kv_move"] is True
    # the other decode takes the KV from the draining one's room, after what the client has
    assert {k: moved[k] for k in MOVE} == MOVE
    assert moved["resume"] == {"output_ids": [0, 1], "text_chars": len("tok0 tok1 ")}
    assert moved["rid"] != first["rid"] and moved["allow_kv_move"] is True
    assert len(p.received) == 1  # the prefill computed nothing for the move
    assert metric(r, "baton_kv_migrations_total") == 1
    assert metric(r, 'baton_router_migrations_total{reason="kv_move"}') == 1
    assert metric(r, "baton_router_migrations_total") == 1
    # a planned hand-over: no failure, no retry
    assert metric(r, "baton_router_upstream_failures_total") == 0
    assert metric(r, "baton_router_retries_total") == 0
    assert 'status="200"} 1.0' in r.metrics()


@pytest.mark.parametrize("path", list(BODIES))
def test_a_drained_stream_is_replayed_without_a_failure(workers: Any, router: Any,
                                                       path: str) -> None:
    r, p, ds = moving_deployment(workers, router)
    ds[0].steer = {"drain_after": 2}
    body = {**BODIES[path], "stream": True, "fake": {"decode": {"chunks": 5}}}
    status, got = sse(r.client, path, body)
    assert status == 200 and got[-1] == "[DONE]"
    assert not any("error" in e or "handover" in e for e in got[:-1]), got
    assert contents(path, got) == [f"tok{i} " for i in range(5)]  # each token once
    replay = ds[1].generation().body
    assert replay["resume"] == {"output_ids": [0, 1], "text_chars": len("tok0 tok1 ")}
    assert replay["bootstrap_port"] == p.bootstrap_port  # a pair's: the prefill recomputes
    assert p.generation(replay["rid"]).body["resume"] == replay["resume"]
    assert metric(r, 'baton_router_migrations_total{reason="drained"}') == 1
    assert metric(r, "baton_router_migrations_total") == 1
    assert metric(r, "baton_router_upstream_failures_total") == 0
    assert metric(r, "baton_router_retries_total") == 0
    assert metric(r, "baton_kv_migrations_total") == 0


def test_a_hand_over_that_cannot_go_on_reaches_the_client_without_its_offer(
        workers: Any, router: Any) -> None:
    """Migrations spent: the client gets the hand-over as a direct client of the decode would,
    without the KV plane's address, then [DONE]; still no failure."""
    r, _, ds = moving_deployment(workers, router, "--max-migrations", "1")
    ds[1].steer = {"drain_after": 3}  # where the moved stream goes on, drained too
    body = {**BODIES["/v1/chat/completions"], "stream": True, "fake": {"decode": {"chunks": 5}}}
    status, got = sse(r.client, "/v1/chat/completions", body)
    assert status == 200 and got[-1] == "[DONE]"
    assert contents("/v1/chat/completions", got) == ["tok0 ", "tok1 ", "tok2 "]
    last = got[-2]
    assert last["handover"]["kind"] == "drained" and last["handover"]["kv_offer"] is None
    assert last["choices"] == [] and last["id"] == got[0]["id"]  # the client's first chunk's
    assert not any("error" in e for e in got[:-1]), got
    assert all(c["finish_reason"] is None for e in got[:-1] for c in e["choices"])
    assert metric(r, 'baton_router_migrations_total{reason="kv_move"}') == 1
    assert metric(r, "baton_router_upstream_failures_total") == 0


@pytest.mark.parametrize("refusal", ["fetch_fails", "a_400"])
def test_a_move_the_other_decode_cannot_take_is_replayed(workers: Any, router: Any,
                                                         refusal: str) -> None:
    """Whatever the taker answers (its fetch failed; even a 4xx), the tokens are replayed."""
    r, p, ds = moving_deployment(workers, router)
    if refusal == "fetch_fails":
        ds[1].broken_links = {MOVE["bootstrap_port"]}  # its fetch from the draining decode fails
    else:
        ds[1].steer = {"status": 400, "message": "refused", "only_port": MOVE["bootstrap_port"]}
    body = {**BODIES["/generate"], "stream": True, "fake": {"decode": {"chunks": 5}}}
    status, got = sse(r.client, "/generate", body)
    assert status == 200 and contents("/generate", got) == [f"tok{i} " for i in range(5)]
    tries = [x.body for x in ds[1].received]
    assert [t["bootstrap_port"] for t in tries] == [MOVE["bootstrap_port"], p.bootstrap_port]
    replay = p.generation(tries[1]["rid"]).body  # the prefill computes prompt + the 2 tokens
    assert replay["resume"] == tries[1]["resume"] == tries[0]["resume"]
    assert metric(r, "baton_kv_migrations_total") == 0
    assert metric(r, "baton_router_migrations_total") == 1


@pytest.mark.parametrize("spoil", ["another_instance", "no_room", "bad_port"])
def test_a_move_that_names_something_else_is_replayed(workers: Any, router: Any,
                                                      spoil: str) -> None:
    """The router takes KV only from the instance it streamed from, at a well-formed room."""
    r, p, ds = moving_deployment(workers, router)
    move: dict[str, Any] = dict(MOVE)
    if spoil == "no_room":
        del move["bootstrap_room"]
    elif spoil == "bad_port":
        move["bootstrap_port"] = 70000
    else:
        move["instance_id"] = "impostor"  # not the instance its /ready names
    ds[0].steer = {"move_after": 2, "move": move}
    body = {**BODIES["/generate"], "stream": True, "fake": {"decode": {"chunks": 5}}}
    status, got = sse(r.client, "/generate", body)
    assert status == 200 and contents("/generate", got) == [f"tok{i} " for i in range(5)]
    assert ds[1].generation().body["bootstrap_port"] == p.bootstrap_port  # a replay
    assert metric(r, "baton_kv_migrations_total") == 0


def test_a_move_is_signed_for_the_draining_decode_and_the_taker(
        workers: Any, router: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    key = secrets.token_hex(32)
    monkeypatch.setenv(ENV, key)
    r, _, ds = moving_deployment(workers, router)
    body = {**BODIES["/generate"], "stream": True, "fake": {"decode": {"chunks": 4}}}
    status, got = sse(r.client, "/generate", body)
    assert status == 200 and contents("/generate", got) == [f"tok{i} " for i in range(4)]
    moved = ds[1].generation().body
    ticket, _ = verify(load_cluster_key(None, {ENV: key}), moved["bootstrap_ticket"])
    assert (ticket.prefill, ticket.decode) == (ds[0].instance_id, ds[1].instance_id)
    assert (ticket.host, ticket.port, ticket.rooms) == (
        MOVE["bootstrap_host"], MOVE["bootstrap_port"], [MOVE["bootstrap_room"]])
    assert ticket.covers(MOVE["bootstrap_room"], moved["rid"])
