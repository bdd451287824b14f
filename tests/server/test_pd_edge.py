"""The HTTP side's disaggregation edge (runtime/server/pd_edge.py), role by role: what each
choice's Bootstrap is, when a ticket is asked for and checked, which first outputs make a 502,
and what /ready adds for the router."""

from __future__ import annotations

import dataclasses

import pytest

from runtime.auth.key import ClusterKey
from runtime.auth.ticket import TicketGate, TicketRefused, sign
from runtime.config import ServerArgs
from runtime.handover import Bootstrap
from runtime.messages import FinishReason, SchedulerReady
from runtime.protocol import GenerateBody
from runtime.server.pd_edge import PDEdge
from runtime.validation import InvalidRequest

KEY, NO_KEY = ClusterKey(b"k" * 32), ClusterKey.none()
INFO = SchedulerReady(context_len=8192, vocab_size=100, kv_capacity_tokens=4096,
                      max_running_requests=8, kv_transfer={"backend": "tcp"},
                      instance_id="baton-decode-D")


def edge(role: str, key: ClusterKey = NO_KEY, local_prefill: bool = False) -> PDEdge:
    args = ServerArgs(role=role)  # type: ignore[arg-type]
    args = dataclasses.replace(args, disagg=dataclasses.replace(
        args.disagg, allow_local_prefill=local_prefill))
    return PDEdge(args, TicketGate(key, role))


def body(**fields: object) -> GenerateBody:
    return GenerateBody(input_ids=[1, 2, 3], rid="r", **fields)  # type: ignore[arg-type]


PAIRED = dict(bootstrap_host="10.0.0.1", bootstrap_port=8998, bootstrap_room=7)


def test_each_choice_gets_one_frozen_bootstrap() -> None:
    [boot] = edge("decode").bootstraps(body(**PAIRED, bootstrap_ticket="t"), 1, INFO)
    assert boot == Bootstrap(7, "10.0.0.1", 8998, "t")
    with pytest.raises(dataclasses.FrozenInstanceError):
        boot.room = 8  # type: ignore[misc]
    boots = edge("prefill").bootstraps(body(**{**PAIRED, "bootstrap_room": [7, 9]}), 2, INFO)
    assert [b.room for b in boots if b is not None] == [7, 9]


def test_colocated_keeps_a_room_alone_and_a_decode_needs_all_three() -> None:
    assert edge("colocated").bootstraps(body(), 2, None) == [None, None]
    assert edge("colocated").bootstraps(body(bootstrap_room=5), 1, None) == [Bootstrap(5)]
    with pytest.raises(InvalidRequest, match="needs bootstrap_host, bootstrap_port and bootstrap_room"):
        edge("decode").bootstraps(body(bootstrap_room=5), 1, INFO)
    # a decode that prefills what comes without any bootstrap field (the router's fallback)
    assert edge("decode", local_prefill=True).bootstraps(body(), 1, INFO) == [None]
    with pytest.raises(InvalidRequest):  # one field is not "none": it is a broken pairing
        edge("decode", local_prefill=True).bootstraps(body(bootstrap_room=5), 1, INFO)


def test_with_a_cluster_key_the_ticket_is_checked_at_the_edge() -> None:
    with pytest.raises(TicketRefused) as e:
        edge("decode", KEY).bootstraps(body(**PAIRED), 1, INFO)
    assert e.value.status == 401
    b = body(**PAIRED)
    ticket = sign(KEY, 7, "r", "baton-prefill-P", "10.0.0.1", 8998, "baton-decode-D",
                  b.prompt_digest())
    [boot] = edge("decode", KEY).bootstraps(body(**PAIRED, bootstrap_ticket=ticket), 1, INFO)
    assert boot is not None and boot.ticket == ticket
    other = dataclasses.replace(INFO, instance_id="baton-decode-E")  # not the one it names
    with pytest.raises(TicketRefused) as e:
        edge("decode", KEY).bootstraps(body(**PAIRED, bootstrap_ticket=ticket), 1, other)
    assert e.value.status == 403


def test_a_failed_hand_off_is_the_roles_to_call() -> None:
    abort, none = FinishReason("abort", message="KV never came"), None
    assert edge("colocated").failed_handoff([(abort, [])]) is None
    assert edge("prefill").failed_handoff([(abort, [5])]) == "KV never came"  # any abort
    assert edge("decode").failed_handoff([(abort, [])]) == "KV never came"  # before a token
    assert edge("decode").failed_handoff([(abort, [5])]) is None  # its tokens went out
    assert edge("decode").failed_handoff([(none, [5]), (FinishReason("length"), [6])]) is None


def test_ready_tells_the_router_what_it_pairs_by() -> None:
    assert edge("colocated").ready_fields(dataclasses.replace(INFO, kv_transfer=None)) == {}
    assert edge("decode", local_prefill=True).ready_fields(INFO) == {
        "kv_transfer": {"backend": "tcp"}, "instance_id": "baton-decode-D", "local_prefill": True,
        "tp": 1}
    assert edge("prefill").ready_fields(INFO)["local_prefill"] is False
