"""One client request as the router forwards it (.notes/pd_contract.md "Router -> workers").

Both sides get the client's JSON body plus `rid`, `bootstrap_host`, `bootstrap_port` and
`bootstrap_room`; the prefill side also gets `"stream": false` and no `stream_options`.
"""

from __future__ import annotations

import json
import secrets
import uuid
from dataclasses import dataclass
from typing import Any

from runtime.router.errors import RouterError
from runtime.router.workers import Worker

GENERATE, COMPLETIONS, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
ENDPOINTS = (GENERATE, COMPLETIONS, CHAT)
MAX_CHOICES = 1024  # far above what a worker accepts (n <= 16, 16 prompts); bounds the rooms


@dataclass(frozen=True)
class PDRequest:
    endpoint: str
    body: dict[str, Any]  # the client's body with `rid` and `bootstrap_room` set
    prompt: str | None  # the prompt as text, for the prefix policy

    @property
    def rid(self) -> str:
        return str(self.body["rid"])

    def for_decode(self, prefill: Worker) -> dict[str, Any]:
        return {**self.body, "bootstrap_host": prefill.host,
                "bootstrap_port": prefill.bootstrap_port}

    def for_prefill(self, prefill: Worker) -> dict[str, Any]:
        body = self.for_decode(prefill)
        body.pop("stream_options", None)
        return {**body, "stream": False}


def parse_request(endpoint: str, raw: bytes) -> PDRequest:
    """The client's body, checked only as far as routing needs; the workers validate the rest
    (their 4xx reaches the client as is)."""
    body = _json_object(raw)
    body["rid"] = _rid(endpoint, body)
    if body.get("bootstrap_room") is None:  # a room the client chose is kept as is
        body["bootstrap_room"] = new_rooms(choice_count(endpoint, body))
    return PDRequest(endpoint, body, prompt_text(endpoint, body))


def parse_abort(raw: bytes) -> str:
    """The rid of `POST /abort {"rid": X}`."""
    rid = _json_object(raw).get("rid")
    if not isinstance(rid, str) or not rid:
        raise RouterError(400, "rid must be a non-empty string", param="rid")
    return rid


def new_rooms(count: int) -> int | list[int]:
    """Random 63-bit rooms, all distinct: an int for one choice, else one per choice."""
    rooms: set[int] = set()
    ordered: list[int] = []
    while len(ordered) < count:
        room = secrets.randbits(63)
        if room not in rooms:
            rooms.add(room)
            ordered.append(room)
    return ordered[0] if count == 1 else ordered


def choice_count(endpoint: str, body: dict[str, Any]) -> int:
    """Sequences the request generates: OpenAI `n` per prompt, prompts in a list on
    /v1/completions (choice index = prompt_index * n + j). Values the workers will reject
    count as 1."""
    if endpoint == GENERATE:
        return 1
    n = _as_count(body.get("n", 1))
    prompts = _prompt_count(body.get("prompt")) if endpoint == COMPLETIONS else 1
    if n * prompts > MAX_CHOICES:
        raise RouterError(400, f"{n * prompts} choices requested; at most {MAX_CHOICES}",
                          param="n")
    return n * prompts


def _as_count(value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return 1
    return value


def _prompt_count(prompt: Any) -> int:
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return len(prompt)  # several prompts: texts or token-id lists
    return 1  # one text, one token-id list, or something the worker rejects


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise RouterError(400, f"malformed JSON body: {e}", code="json_invalid") from None
    if not isinstance(body, dict):
        raise RouterError(400, f"the body must be a JSON object, not {type(body).__name__}",
                          code="json_invalid")
    return body


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _rid(endpoint: str, body: dict[str, Any]) -> str:
    """The client's rid on /generate, else a fresh one (OpenAI endpoints always get ours)."""
    rid = body.get("rid")
    if endpoint != GENERATE or rid is None:
        return uuid.uuid4().hex
    if not isinstance(rid, str) or not rid:
        raise RouterError(400, "rid must be a non-empty string", param="rid")
    return rid


def prompt_text(endpoint: str, body: dict[str, Any]) -> str | None:
    """The prompt as one string (token ids as "1,2,3,"; chat messages rendered in order)."""
    if endpoint == CHAT:
        return _chat_text(body.get("messages"))
    prompt = body.get("text") if endpoint == GENERATE else body.get("prompt")
    if endpoint == GENERATE and prompt is None:
        prompt = body.get("input_ids")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # several prompts: the first one decides
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "".join(f"{t}," for t in prompt)
    return None


def _chat_text(messages: Any) -> str | None:
    if not isinstance(messages, list):
        return None
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            return None
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"<{m.get('role')}>{content or ''}\n")
    return "".join(parts)
