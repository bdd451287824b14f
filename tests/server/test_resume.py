"""Resuming a stream on a worker (runtime/server/resume.py), against the real model: for every
cut point, what the client had before the cut + the resumed stream equals the undisturbed
stream — ids, text, finish reason and usage — on /generate and both OpenAI endpoints (whose
chunks carry `token_ids` when the router asks)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.server.server_process import ServerProcess

MAX = 14
PROMPT = "Write a short poem about the sea:"
CHAT = [{"role": "user", "content": "Name three fruits and say why you like them."}]


def stream(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: {")]


def pieces(path: str, events: list[dict[str, Any]]) -> list[tuple[list[int], str]]:
    """Each content event's (token ids, text)."""
    out = []
    for e in events:
        if path == "/generate":
            out.append((e["output_ids"], e["text"]))
        elif e.get("choices"):
            choice = e["choices"][0]
            text = choice["text"] if path == "/v1/completions" else choice["delta"].get("content")
            out.append((choice["token_ids"], text or ""))
    return out


def finish_and_usage(path: str, events: list[dict[str, Any]]) -> tuple[Any, Any]:
    if path == "/generate":
        meta = events[-1]["meta_info"]
        return meta["finish_reason"], (meta["prompt_tokens"], meta["completion_tokens"])
    finish = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")][-1]
    usage = dict(events[-1]["usage"])
    assert usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
    usage.pop("prompt_tokens_details")  # what the prefix cache held: not the same each time
    return finish, usage


BODIES = {
    "/generate": {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": MAX}},
    "/v1/completions": {"model": "smollm2", "prompt": PROMPT, "max_tokens": MAX,
                        "temperature": 0, "return_token_ids": True,
                        "stream_options": {"include_usage": True}},
    "/v1/chat/completions": {"model": "smollm2", "messages": CHAT, "max_tokens": MAX,
                             "temperature": 0, "return_token_ids": True,
                             "stream_options": {"include_usage": True}},
}


@pytest.mark.parametrize("path", list(BODIES))
def test_a_resumed_stream_goes_on_where_the_client_stopped(client: httpx.Client,
                                                           path: str) -> None:
    body = BODIES[path]
    whole = stream(client, path, body)
    parts = pieces(path, whole)
    ids = [t for p, _ in parts for t in p]
    text = "".join(t for _, t in parts)
    assert len(ids) == MAX
    for cut in (1, 5, len(parts) - 1):
        had_ids = [t for p, _ in parts[:cut] for t in p]
        had_text = "".join(t for _, t in parts[:cut])
        rest = stream(client, path, {**body, "resume": {
            "output_ids": had_ids, "text_chars": len(had_text)}})
        got = pieces(path, rest)
        assert had_ids + [t for p, _ in got for t in p] == ids, cut
        assert had_text + "".join(t for _, t in got) == text, cut
        assert finish_and_usage(path, rest) == finish_and_usage(path, whole)


def test_resume_is_checked(client: httpx.Client) -> None:
    body = BODIES["/generate"]
    r = client.post("/generate", json={**body, "resume": {"output_ids": list(range(MAX))}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "resume"
    r = client.post("/v1/completions", json={**BODIES["/v1/completions"], "n": 2,
                                             "stream": True, "resume": {"output_ids": [1]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "resume"
    r = client.post("/generate", json={**body, "resume": {"output_ids": [-1]}})
    assert r.status_code == 400


def test_token_ids_only_when_asked(server: ServerProcess, client: httpx.Client) -> None:
    plain = {k: v for k, v in BODIES["/v1/completions"].items() if k != "return_token_ids"}
    events = stream(client, "/v1/completions", plain)
    assert all("token_ids" not in c for e in events for c in e.get("choices", []))


PENALIZED = {"text": "Say it again and again: yes, yes, yes, yes,", "sampling_params": {
    "temperature": 0, "max_new_tokens": MAX, "frequency_penalty": 2.0, "presence_penalty": 2.0}}


def test_a_resumed_stream_keeps_its_penalties(client: httpx.Client) -> None:
    """Penalties count the resumed tokens as outputs: strong frequency and presence
    penalties make the continuation depend on them (the repetition penalty, which counts the
    prompt too, would not tell)."""
    whole = [t for p, _ in pieces("/generate", stream(client, "/generate", PENALIZED)) for t in p]
    plain = [t for p, _ in pieces("/generate", stream(client, "/generate", BODIES["/generate"]))
             for t in p]
    assert whole != plain  # the penalties change the output
    for cut in (2, 7):
        rest = stream(client, "/generate", {**PENALIZED, "resume": {"output_ids": whole[:cut]}})
        assert whole[:cut] + [t for p, _ in pieces("/generate", rest) for t in p] == whole, cut
