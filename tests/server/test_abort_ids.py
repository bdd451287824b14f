"""Issue 12, item 8: `/abort` takes the ids a client sees — the OpenAI response id (`cmpl-…`,
`chatcmpl-…`: every choice of it), the `rid` given to an OpenAI request, a /generate rid — and
nothing else (a /generate rid "job" is not the request "job-2")."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.server.server_process import ServerProcess
from tests.server.test_concurrency import _wait_idle

LONG = {"max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}


class Stream:
    """A streaming request read on a thread: its events, and the first one's arrival."""

    def __init__(self, url: str, path: str, body: dict[str, Any]) -> None:
        self.events: list[Any] = []
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url, path, body), daemon=True)
        self.thread.start()

    def _read(self, url: str, path: str, body: dict[str, Any]) -> None:
        with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", path, json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    self.started.set()

    def wait_first(self) -> Any:
        assert self.started.wait(60), "no first event"
        return self.events[0]

    def finish(self) -> list[Any]:
        self.thread.join(60)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.events[-1] == "[DONE]", self.events[-3:]
        return self.events[:-1]


def _openai_reasons(events: list[Any]) -> dict[int, str]:
    return {c["index"]: c["finish_reason"] for e in events for c in e["choices"]
            if c["finish_reason"]}


def _completion(**kw: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/completions", {"model": "smollm2", "prompt": "Count:", "n": 2, **LONG, **kw}


def _chat(**kw: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {"model": "smollm2", "n": 2, **LONG, **kw,
                                    "messages": [{"role": "user", "content": "Count."}]}


ID_OF: dict[str, Callable[[Any], str]] = {
    "cmpl-id": lambda first: first["id"],
    "chatcmpl-id": lambda first: first["id"],
    "client-rid": lambda _: "my-openai-request",
}
REQUESTS = {"cmpl-id": _completion(), "chatcmpl-id": _chat(),
            "client-rid": _completion(rid="my-openai-request")}


@pytest.mark.parametrize("kind", list(ID_OF))
def test_abort_by_the_id_the_client_sees(server: ServerProcess, client: httpx.Client,
                                         kind: str) -> None:
    _wait_idle(client)
    path, body = REQUESTS[kind]
    stream = Stream(server.url, path, body)
    rid = ID_OF[kind](stream.wait_first())
    assert rid.startswith({"cmpl-id": "cmpl-", "chatcmpl-id": "chatcmpl-"}.get(kind, "my-"))
    assert client.post("/abort", json={"rid": rid}).json() == {"rid": rid, "aborted": True}
    assert _openai_reasons(stream.finish()) == {0: "abort", 1: "abort"}
    assert client.post("/abort", json={"rid": rid}).json()["aborted"] is False
    _wait_idle(client)


def _generate(rid: str) -> dict[str, Any]:
    return {"text": "Count:", "rid": rid, "stream": True, "sampling_params": {
        "max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}}


def test_abort_by_rid_does_not_take_a_neighbour(server: ServerProcess,
                                                client: httpx.Client) -> None:
    _wait_idle(client)
    job, neighbour = Stream(server.url, "/generate", _generate("job")), Stream(
        server.url, "/generate", _generate("job-2"))
    job.wait_first(), neighbour.wait_first()
    assert client.post("/abort", json={"rid": "job"}).json()["aborted"] is True
    events = job.finish()
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert neighbour.thread.is_alive(), "aborting 'job' ended 'job-2' too"
    assert client.post("/abort", json={"rid": "job-2"}).json()["aborted"] is True
    assert neighbour.finish()[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    _wait_idle(client)
