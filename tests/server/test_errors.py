"""Bad input gets a 4xx JSON error naming the problem — never a 5xx, never a hang."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.server_process import ServerProcess

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

CASES: list[tuple[str, str, Any, int, str]] = [
    # (name, path, json body or raw bytes, status, text the message must contain)
    ("malformed-json", COMP, b'{"model": "smollm2", "prompt": ', 400, "JSON"),
    ("not-an-object", COMP, b"[1, 2, 3]", 400, "JSON object"),
    ("missing-prompt", COMP, {"model": "smollm2"}, 400, "prompt"),
    ("missing-model", CHAT, {"messages": MSG}, 400, "model"),
    ("ill-typed-max-tokens", COMP, {"model": "smollm2", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("ill-typed-stream", CHAT, {"model": "smollm2", "messages": MSG, "stream": "yes"}, 400, "stream"),
    ("zero-max-tokens", COMP, {"model": "smollm2", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("negative-max-tokens", CHAT, {"model": "smollm2", "messages": MSG, "max_tokens": -3}, 400, "max_tokens"),
    ("negative-temperature", COMP, {"model": "smollm2", "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("unknown-model", CHAT, {"model": "gpt-9", "messages": MSG}, 404, "gpt-9"),
    ("empty-messages", CHAT, {"model": "smollm2", "messages": []}, 400, "messages"),
    ("bad-role", CHAT, {"model": "smollm2", "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("empty-prompt", COMP, {"model": "smollm2", "prompt": ""}, 400, "prompt"),
    ("prompt-too-long", COMP, {"model": "smollm2", "prompt": "hello " * 9000, "max_tokens": 4}, 400, "context"),
    ("too-many-new-tokens", COMP, {"model": "smollm2", "prompt": "x", "max_tokens": 100000}, 400, "maximum context length"),
    ("kv-pool-too-small", COMP, {"model": "smollm2", "prompt": "x", "max_tokens": 5000}, 400, "max_tokens (5000)"),
    ("huge-int", COMP, {"model": "smollm2", "prompt": "x", "max_tokens": 10**30}, 400, "max_tokens"),
    ("echo", COMP, {"model": "smollm2", "prompt": "x", "echo": True}, 400, "echo"),
    ("both-prompts", "/generate", {"text": "x", "input_ids": [1]}, 400, "exactly one"),
    ("unknown-sampling-param", "/generate", {"text": "x", "sampling_params": {"nope": 1}}, 400, "nope"),
    ("token-out-of-vocab", "/generate", {"input_ids": [10**9]}, 400, "token ids"),
    ("huge-native-int", "/generate", {"text": "x", "sampling_params": {"seed": 2**70}}, 400, "range"),
    ("abort-without-rid", "/abort", {}, 400, "rid"),
]


def _post(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"content-type": "application/json"})
    return client.post(path, json=body)


@pytest.mark.parametrize(("name", "path", "body", "status", "needle"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_named_4xx(client: httpx.Client, name: str, path: str, body: Any, status: int, needle: str) -> None:
    r = _post(client, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"}
    assert needle.lower() in err["message"].lower(), err


def test_oversized_body_is_413(client: httpx.Client) -> None:
    body = b'{"model": "smollm2", "prompt": "' + b"a" * (2 << 20) + b'"}'
    r = client.post(COMP, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]


def test_oversized_chunked_body_is_413(client: httpx.Client) -> None:
    def chunks():  # type: ignore[no-untyped-def]
        yield b'{"model": "smollm2", "prompt": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'

    r = client.post(COMP, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text


def test_unknown_route_and_method_are_json(client: httpx.Client) -> None:
    r = client.get("/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    r = client.get(COMP)
    assert r.status_code == 405 and "error" in r.json()


def test_streaming_request_refused_before_streaming(client: httpx.Client) -> None:
    r = client.post(COMP, json={"model": "smollm2", "prompt": "hello " * 9000, "stream": True})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]


def test_server_keeps_serving(server: ServerProcess, client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    metrics = client.get("/metrics").text
    assert 'baton_http_errors_total{status="400"}' in metrics
    r = client.post(COMP, json={"model": "smollm2", "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_bootstrap_rooms_say_what_is_wrong_with_them() -> None:
    from runtime.protocol import GenerateBody
    from runtime.validation import InvalidRequest

    pd = {"text": "x", "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998}
    for rooms, choices, says in (([7, 7, 7, 7], 4, "7 repeated"), ([1, 2, 1, 2, 3], 5, "1, 2 repeated"),
                                 ([1, 2], 3, "give 3 room(s), one per choice; got 2")):
        body = GenerateBody.model_validate({**pd, "bootstrap_room": rooms})
        with pytest.raises(InvalidRequest, match="bootstrap_room: ") as e:
            body.rooms("decode", choices)
        assert says in str(e.value), e.value
    assert GenerateBody.model_validate({**pd, "bootstrap_room": [3, 4]}).rooms("prefill", 2) == [3, 4]
