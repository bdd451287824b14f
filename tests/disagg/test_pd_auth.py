"""The cluster key at work, against a real prefill + decode pair that run with one: every attack
of the KV-plane review is refused with a 4xx and allocates nothing (issue: KV plane integrity).
- room tickets: missing (401), forged, tampered, expired, replayed, for another room, rid,
  address or instance (403); a decode never contacts a bootstrap address the ticket does not name;
- the prefill's bootstrap server: unsigned calls 401, forged or replayed ones 403, ill-typed
  bodies 400 naming the field, oversized ones 413; what it answers a decode holds nothing of its
  pool; a room whose ticket names another decode is refused."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from runtime.auth.key import ClusterKey
from runtime.auth.signed import sign_call
from runtime.auth.ticket import RoomTicket, sign
from tests.disagg.pd import Pair, instance_id, pd_call, start_pair
from tests.disagg.test_pd_failures import FAST, eventually, kv_free, metric


@pytest.fixture(scope="module")
def pair(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = start_pair(tmp_path_factory.mktemp("auth"), "tcp", *FAST, model=str(tiny_path))
    yield p
    p.stop()


def key(pair: Pair) -> ClusterKey:
    assert pair.key
    return ClusterKey(pair.key.encode())


def body(pair: Pair, **fields: Any) -> dict[str, Any]:
    return {"text": "Hello there", "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            **pair.fields(prompt={"text": "Hello there"}), **fields}


def refused(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (code, "bootstrap_ticket"), error


def nothing_held(pair: Pair) -> None:
    for srv in (pair.prefill, pair.decode):
        assert kv_free(srv.url)
        assert httpx.get(f"{srv.url}/debug/stats").json()["inflight"] == 0


def test_a_signed_request_works(pair: Pair) -> None:
    async def go() -> tuple[httpx.Response, Any]:
        async with httpx.AsyncClient(timeout=60) as http:
            return await pd_call(http, pair, "/generate", body(pair))

    p, d = asyncio.run(go())
    assert p.status_code == 200 and len(d["output_ids"]) == 4


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_bad_tickets_are_refused_and_allocate_nothing(pair: Pair, side: str) -> None:
    url = f"{getattr(pair, side).url}/generate"
    b = body(pair)
    good = b["bootstrap_ticket"]
    version, payload, mac = good.split(".")
    ticket = RoomTicket(**json.loads(_unb64(payload)))
    other = ClusterKey(b"another deployment's key")
    cases = {
        "missing": ({**b, "bootstrap_ticket": None}, 401, "ticket_required"),
        "garbage": ({**b, "bootstrap_ticket": "v1.abc"}, 403, "ticket_forged"),
        "other key": ({**b, "bootstrap_ticket": _resign(ticket, other)}, 403, "ticket_forged"),
        "tampered": ({**b, "bootstrap_ticket": f"{version}.{_b64(_payload(ticket, rooms=[1]))}.{mac}"},
                     403, "ticket_forged"),
        "expired": ({**b, "bootstrap_ticket": _resign(ticket, key(pair), exp=time.time() - 1)},
                    403, "ticket_expired"),
        "another room": ({**b, "bootstrap_room": b["bootstrap_room"] ^ 1}, 403, "ticket_mismatch"),
        "another rid": ({**b, "rid": "someone-else"}, 403, "ticket_mismatch"),
        "another port": ({**b, "bootstrap_port": 1}, 403, "ticket_mismatch"),
        # one unused ticket, prompt A to one side and B to the other: B answered with A's KV
        "another prompt": ({**b, "text": "Goodbye there"}, 403, "ticket_mismatch"),
        "ids for text": ({**b, "text": None, "input_ids": [19556, 612]}, 403, "ticket_mismatch"),
        "a resume": ({**b, "resume": {"output_ids": [42], "text_chars": 1}}, 403, "ticket_mismatch"),
        "another instance": ({**b, "bootstrap_ticket": _resign(
            ticket, key(pair), **{side: "baton-someone-else"})}, 403, "ticket_other_instance"),
    }
    for name, (sent, status, code) in cases.items():
        r = httpx.post(url, json=sent, timeout=30)
        try:
            refused(r, status, code)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    nothing_held(pair)


def test_a_replayed_ticket_is_refused(pair: Pair) -> None:
    b = body(pair)

    async def twice() -> tuple[Any, list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=60) as http:
            first = await pd_call(http, pair, "/generate", b)
            again = [await http.post(f"{srv.url}/generate", json=b)
                     for srv in (pair.prefill, pair.decode)]
            return first, again

    (p, d), again = asyncio.run(twice())
    assert p.status_code == 200 and len(d["output_ids"]) == 4
    for r in again:
        refused(r, 403, "ticket_replayed")
    nothing_held(pair)


def test_a_decode_never_contacts_an_address_outside_its_ticket(pair: Pair) -> None:
    """SSRF: the body names a listener of the caller's choosing; the ticket (for the real
    prefill) does not cover it, so the decode refuses before contacting anything."""
    trap = socket.create_server(("127.0.0.1", 0))
    trap.settimeout(3)
    touched = threading.Event()

    def watch() -> None:
        try:
            trap.accept()
            touched.set()
        except OSError:
            pass

    t = threading.Thread(target=watch)
    t.start()
    b = body(pair, bootstrap_port=trap.getsockname()[1])  # the ticket names the real prefill
    r = httpx.post(f"{pair.decode.url}/generate", json=b, timeout=30)
    refused(r, 403, "ticket_mismatch")
    t.join(5)
    trap.close()
    assert not touched.is_set(), "the decode connected to an address no ticket named"
    nothing_held(pair)


# ---- the prefill's bootstrap server ------------------------------------------------------------


def boot(pair: Pair) -> str:
    return f"http://127.0.0.1:{pair.bootstrap_port}"


def signed(pair: Pair, method: str, path: str, payload: dict[str, Any] | None,
           k: ClusterKey | None = None) -> tuple[bytes, dict[str, str]]:
    raw = json.dumps(payload).encode() if payload is not None else b""
    return raw, {"Content-Type": "application/json",
                 **sign_call(k or key(pair), method, path, raw)}


def registration(pair: Pair, decode_id: str) -> dict[str, Any]:
    headers = signed(pair, "GET", "/route", None)[1]
    layout = httpx.get(f"{boot(pair)}/route", headers=headers).json()["layout"]
    return {"decode_id": decode_id, "receiver_host": "127.0.0.1", "receiver_port": 9,
            "layout": layout, "backend": "tcp"}


def test_bootstrap_calls_must_be_signed_by_this_deployment(pair: Pair) -> None:
    before = metric(pair.prefill.url, 'baton_kv_plane_events_total{kind="bad_call"}')
    peer = registration(pair, "baton-decode-fake")
    room = {"room": 5, "decode_id": "baton-decode-fake", "rid": "x", "prompt_len": 3,
            "dst_pages": [0]}
    for method, path, payload in (("POST", "/peers", peer), ("POST", "/rooms", room),
                                  ("DELETE", "/rooms/5", None), ("GET", "/route", None)):
        raw = json.dumps(payload).encode() if payload else b""
        r = httpx.request(method, f"{boot(pair)}{path}", content=raw)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", r.text
        raw, headers = signed(pair, method, path, payload, ClusterKey(b"not the key of this one"))
        r = httpx.request(method, f"{boot(pair)}{path}", content=raw, headers=headers)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", r.text
    # a call recorded on the wire cannot be replayed, nor moved to another path
    raw, headers = signed(pair, "POST", "/peers", peer)
    first = httpx.post(f"{boot(pair)}/peers", content=raw, headers=headers)
    assert first.status_code == 200 and first.json() == {"backend_info": {}}, first.text
    again = httpx.post(f"{boot(pair)}/peers", content=raw, headers=headers)
    assert again.status_code == 403 and "used before" in again.json()["error"]["message"]
    raw, headers = signed(pair, "DELETE", "/rooms/5", None)
    moved = httpx.delete(f"{boot(pair)}/rooms/6", headers=headers)
    assert moved.status_code == 403, moved.text
    # 2 refused calls of each of the 4 kinds, the replay and the moved call
    eventually(lambda: metric(pair.prefill.url, 'baton_kv_plane_events_total{kind="bad_call"}')
               >= before + 10)
    nothing_held(pair)


def test_bootstrap_bodies_are_typed_and_bounded(pair: Pair) -> None:
    peer = registration(pair, "baton-decode-typed")
    for field, value in (("receiver_port", "80"), ("decode_id", ["x"]), ("layout", {"a": 1}),
                         ("receiver_port", 70000)):
        raw, headers = signed(pair, "POST", "/peers", {**peer, field: value})
        r = httpx.post(f"{boot(pair)}/peers", content=raw, headers=headers)
        assert r.status_code == 400 and ("PeerRegistration." in r.text or "KVLayout" in r.text), r.text
    raw, headers = signed(pair, "POST", "/peers", peer)
    assert httpx.post(f"{boot(pair)}/peers", content=raw, headers=headers).status_code == 200
    room = {"room": 7, "decode_id": "baton-decode-typed", "rid": "x", "prompt_len": 3,
            "dst_pages": [0], "ticket": None}
    for field, value in (("room", "abc"), ("prompt_len", "zz"), ("room", -1),
                         ("dst_pages", [True]), ("room", 2**64)):
        raw, headers = signed(pair, "POST", "/rooms", {**room, field: value})
        r = httpx.post(f"{boot(pair)}/rooms", content=raw, headers=headers)
        assert r.status_code == 400 and f"RoomRequest.{field}" in r.text, r.text
    # a well-typed room without a ticket, or with one for another decode, is refused
    raw, headers = signed(pair, "POST", "/rooms", room)
    r = httpx.post(f"{boot(pair)}/rooms", content=raw, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "ticket_required", r.text
    ticket = sign(key(pair), 7, "x", instance_id(pair.prefill), "127.0.0.1", pair.bootstrap_port,
                  instance_id(pair.decode), "")  # the real decode's, not this caller's
    raw, headers = signed(pair, "POST", "/rooms", {**room, "ticket": ticket})
    r = httpx.post(f"{boot(pair)}/rooms", content=raw, headers=headers)
    assert r.status_code == 403 and r.json()["error"]["code"] == "ticket_mismatch", r.text
    with socket.create_connection(("127.0.0.1", pair.bootstrap_port), timeout=5) as s:
        s.sendall(b"POST /peers HTTP/1.1\r\nHost: x\r\nContent-Length: 67108864\r\n\r\n")
        head = s.recv(200).decode()
    assert head.startswith("HTTP/1.1 413"), head
    nothing_held(pair)


def test_a_nixl_prefill_hands_no_pool_metadata(tiny_path: Path, tmp_path: Path) -> None:
    """With nixl, a decode that registers (here a real nixl agent in this process, signing with
    the key) gets nothing back: no agent metadata, no pool address, with which a foreign agent
    could read and write the prefill's pool."""
    pytest.importorskip("nixl")
    from runtime.disagg.transfer.base import create_transfer
    from runtime.kvcache.pool import KVPool

    p = start_pair(tmp_path, "nixl", *FAST, model=str(tiny_path))
    try:
        layout = httpx.get(f"{boot(p)}/route", headers=signed(p, "GET", "/route", None)[1]).json()["layout"]
        pool = KVPool(layout["num_layers"], 4, layout["page_size"], layout["num_kv_heads"],
                      layout["head_dim"], getattr(torch, layout["dtype"]))
        agent = create_transfer("nixl", pool, "baton-decode-test-agent")
        peer = {"decode_id": "baton-decode-test-agent", "receiver_host": "127.0.0.1",
                "receiver_port": 9, "layout": layout, "backend": "nixl",
                "backend_info": agent.local_info()}
        raw, headers = signed(p, "POST", "/peers", peer)
        r = httpx.post(f"{boot(p)}/peers", content=raw, headers=headers, timeout=30)
        assert r.status_code == 200 and r.json() == {"backend_info": {}}, r.text
        agent.close()
        # a signed registration whose nixl metadata is garbage: refused, in words (no dropped
        # connection from an exception nixl raised in the handler)
        info = peer["backend_info"]
        for garbage in ({**info, "metadata": base64.b64encode(b"garbage").decode()},
                        {**info, "metadata": "%%%"}, {**info, "addr": "x"}, {}):
            raw, headers = signed(p, "POST", "/peers", {**peer, "backend_info": garbage})
            r = httpx.post(f"{boot(p)}/peers", content=raw, headers=headers, timeout=30)
            assert r.status_code == 409 and r.json()["error"]["code"] == "peer_rejected", r.text
    finally:
        p.stop()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _payload(ticket: RoomTicket, **changes: Any) -> bytes:
    return json.dumps({**asdict(ticket), **changes}, separators=(",", ":"), sort_keys=True).encode()


def _resign(ticket: RoomTicket, k: ClusterKey, **changes: Any) -> str:
    return replace(ticket, **changes).sign(k)
