"""Chat messages are checked per role as OpenAI's API checks them, and a 400 names the client's
own fields, never pydantic's internals (union members like `list[function-before[...]]`)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

BAD = [
    ([{"role": "tool", "content": "42"}], "messages.0.tool_call_id", "needs tool_call_id"),
    ([{"role": "user"}], "messages.0.content", "needs content"),
    ([{"role": "system", "content": None}], "messages.0.content", "needs content"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}], "messages.1.content",
     "needs content"),
    ([{"role": "user", "content": "hi", "tool_call_id": "c1"}], "messages.0.tool_call_id",
     "no tool_call_id"),
    ([{"role": "user", "content": "hi", "tool_calls": []}], "messages.0.tool_calls",
     "no tool_calls"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}],
     "messages.0.tool_calls", "does not call tools"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages.0.content", "'text'"),
]


def chat(client: httpx.Client, messages: list[dict[str, Any]]) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": "smollm2", "messages": messages,
                                                     "max_tokens": 2})


@pytest.mark.parametrize("messages,param,says", BAD)
def test_messages_that_break_their_roles_rules_are_400s(client: httpx.Client,
                                                        messages: list[dict[str, Any]],
                                                        param: str, says: str) -> None:
    r = chat(client, messages)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_every_role_with_what_it_takes_is_served(client: httpx.Client) -> None:
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "ann"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Again?"}]
    assert chat(client, messages).status_code == 200


@pytest.mark.parametrize("prompt", [[1, -2], 5, [[1], ["x"]], [True]])
def test_a_400_names_only_the_clients_fields(client: httpx.Client, prompt: Any) -> None:
    r = client.post("/v1/completions", json={"model": "smollm2", "prompt": prompt})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    for internal in ("function-before", "constrained-", "list[", "_integral"):
        assert internal not in message, message
    assert r.json()["error"]["param"].startswith("prompt")
