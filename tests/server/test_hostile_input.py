"""Issue 12, items 1, 2, 6, 7, 8: what a hostile client broke. Every case is a 4xx whose JSON
error names the field, on the shared server; the connection it came on stays usable."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest

from tests.server.hostile_cases import (
    CHAT,
    COMP,
    CONTENT_TYPE,
    CONTEXT,
    GEN,
    HARMLESS,
    NON_FINITE,
    SURROGATES,
    UNSUPPORTED,
    Case,
    ids,
    raw,
)
from tests.server.server_process import ServerProcess


def check(client: httpx.Client, case: Case) -> dict[str, Any]:
    r = client.post(case.path, content=case.body, headers=case.headers)
    assert r.status_code == case.status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"}, err
    assert err["param"] == case.param, err
    assert case.needle.lower() in err["message"].lower(), err
    return err  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", SURROGATES, ids=ids(SURROGATES))
def test_lone_surrogates_are_a_400_naming_the_field(client: httpx.Client, case: Case) -> None:
    check(client, case)


def exchange(sock: socket.socket, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 exchange on an open socket: (status, headers, body)."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed by the server after {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def test_the_connection_survives_a_hostile_request(server: ServerProcess) -> None:
    """The 500 used to drop the keep-alive connection without `Connection: close`."""
    body = raw({"model": "smollm2", "prompt": "Hi", "max_tokens": 2, "stop": "\ud800"})
    post = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        status, headers, _ = exchange(sock, post)
        assert status == 400 and headers.get("connection") != "close", headers
        status, _, answer = exchange(sock, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200 and json.loads(answer) == {"status": "ok"}


@pytest.mark.parametrize("case", NON_FINITE, ids=ids(NON_FINITE))
def test_non_finite_numbers_are_a_400_naming_the_field(client: httpx.Client, case: Case) -> None:
    check(client, case)


@pytest.mark.parametrize("case", UNSUPPORTED, ids=ids(UNSUPPORTED))
def test_unsupported_fields_are_a_400_not_ignored(client: httpx.Client, case: Case) -> None:
    check(client, case)


@pytest.mark.parametrize(("path", "body"), HARMLESS, ids=[str(i) for i in range(len(HARMLESS))])
def test_harmless_values_of_those_fields_are_accepted(client: httpx.Client, path: str,
                                                       body: dict[str, Any]) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]")


def _greedy_ids(client: httpx.Client, **sp: Any) -> list[int]:
    body = {"text": "The capital of France is", "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "ignore_eos": True, **sp}}
    r = client.post(GEN, json=body)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]  # type: ignore[no-any-return]


def test_logit_bias_steers_sampling(client: httpx.Client, tokenizer: Any) -> None:
    plain = _greedy_ids(client)
    assert _greedy_ids(client, logit_bias={str(plain[0]): -100})[0] != plain[0]
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    assert _greedy_ids(client, logit_bias={str(forced): 100}) == [forced] * 3
    r = client.post(COMP, json={"model": "smollm2", "prompt": "The capital of France is",
                                "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                                "logit_bias": {str(forced): 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tokenizer.decode([forced] * 3)


@pytest.mark.parametrize("case", CONTEXT, ids=ids(CONTEXT))
def test_context_overflow_is_a_400_with_the_numbers(client: httpx.Client, case: Case) -> None:
    message = check(client, case)["message"]
    assert "9000" in message and "you requested" in message, message


@pytest.mark.parametrize(("path", "body", "default"), [
    (COMP, {"prompt": "Once upon a time", "max_tokens": None}, 16),
    (CHAT, {"messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": None,
            "max_completion_tokens": None}, 128),
], ids=["completions", "chat"])
def test_null_max_tokens_is_the_documented_default(client: httpx.Client, path: str,
                                                   body: dict[str, Any], default: int) -> None:
    r = client.post(path, json={"model": "smollm2", "temperature": 0, "ignore_eos": True, **body},
                    timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == default


@pytest.mark.parametrize("case", CONTENT_TYPE, ids=ids(CONTENT_TYPE))
def test_json_without_its_content_type_says_so(client: httpx.Client, case: Case) -> None:
    message = check(client, case)["message"]
    assert "content-type" in message.lower(), message


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8",
                                          "application/vnd.baton+json"])
def test_json_content_types_are_accepted(client: httpx.Client, content_type: str) -> None:
    body = raw({"model": "smollm2", "prompt": "Hi", "max_tokens": 1})
    r = client.post(COMP, content=body, headers={"content-type": content_type})
    assert r.status_code == 200, r.text
