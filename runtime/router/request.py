"""One client request as the router forwards it (docs/disaggregation.md "Wire contract").

Both sides get the client's JSON body plus `rid`, `bootstrap_host`, `bootstrap_port` and
`bootstrap_room`; the prefill side also gets `"stream": false` and no `stream_options`.
The body is checked first with the workers' own checks and request models
(`runtime.validation`, `runtime.protocol`): what `baton serve` rejects, the router rejects
the same way before any worker sees it. Only what needs the model (its name, the tokenizer, the
context window) is left to the workers, whose 4xx reaches the client as is.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from runtime.auth.key import ClusterKey
from runtime.auth.ticket import sign
from runtime.protocol import (
    PROMPT_FIELDS,
    AbortBody,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateBody,
    prompt_digest,
    prompt_hash,
)
from runtime.router.errors import RouterError
from runtime.router.workers import Worker
from runtime.tokenizer import chat_prompt_ids
from runtime.validation import InvalidRequest, describe_errors, parse_json_body

M = TypeVar("M", bound=BaseModel)

GENERATE, COMPLETIONS, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
ENDPOINTS = (GENERATE, COMPLETIONS, CHAT)
MAX_CHOICES = 1024  # far above what a worker accepts (n <= 16, 16 prompts); bounds the rooms
# what only the router may say to a worker (the wire contract's own fields): a client's are
# dropped, so a client cannot resume from tokens of its choosing, take the token ids the router
# follows a stream by, present a ticket, or let a decode move its KV
ROUTER_ONLY = ("resume", "return_token_ids", "allow_kv_move", "bootstrap_ticket",
               "bootstrap_host", "bootstrap_port")
ClientRequest = GenerateBody | CompletionRequest | ChatCompletionRequest
MODELS: dict[str, type[ClientRequest]] = {
    GENERATE: GenerateBody, COMPLETIONS: CompletionRequest, CHAT: ChatCompletionRequest}


@dataclass(frozen=True)
class RoutedRequest:
    endpoint: str
    body: dict[str, Any]  # the client's body with `rid` and `bootstrap_room` set
    parsed: ClientRequest  # the body as the worker's request model reads it
    ticket: str | None = None  # signed for the pair it goes to (`signed`)
    client_rid: str | None = None  # the rid the client chose (/generate), which it sees back
    kv_from: tuple[str, int] | None = None  # a moved stream's KV: the draining decode's bootstrap
    prompt: str = ""  # runtime.protocol.prompt_hash of the parsed prompt (tickets bind it)
    ids: list[int] | None = None  # its prompt's token ids, for a policy that reads them

    @property
    def rid(self) -> str:
        """The rid the workers know this try by."""
        return str(self.body["rid"])

    def retried(self, attempt: int) -> RoutedRequest:
        """This request for its `attempt`-th retry: fresh rooms and a fresh rid (the pair that
        failed may still hold the old ones). A client's own rid gets a suffix, which the
        exchange takes off again in what the client sees."""
        rooms = self.body["bootstrap_room"]
        rid = uuid.uuid4().hex if self.client_rid is None else f"{self.client_rid}.retry{attempt}"
        body = {**self.body, "rid": rid,
                "bootstrap_room": new_rooms(len(rooms) if isinstance(rooms, list) else 1)}
        return replace(self, body=body, ticket=None)

    def moved(self, host: str, port: int, room: int) -> RoutedRequest:
        """This request (a retry of it) for a decode that takes the KV a draining decode
        offers in `room` at its bootstrap `host`:`port` (runtime/disagg/move.py)."""
        return replace(self, body={**self.body, "bootstrap_room": room}, kv_from=(host, port))

    def signed(self, key: ClusterKey, prefill: Worker, decode: Worker, ttl_s: float) -> RoutedRequest:
        """This request with a room ticket for (prefill, decode) (runtime/auth/ticket.py);
        as it is without a cluster key."""
        host, port = self.kv_from or (prefill.host, prefill.bootstrap_port or 0)
        if not key.enabled:
            return self
        ticket = sign(key, self.body["bootstrap_room"], self.rid, prefill.instance_id or "",
                      host, port, decode.instance_id or "", self.prompt_digest(), ttl_s)
        return replace(self, ticket=ticket)

    def prompt_digest(self) -> str:
        """What the workers compute from the body they get (runtime.protocol.prompt_digest):
        the prompt as parsed, and the `resume` this router added, if any."""
        return prompt_digest({"resume": self.body.get("resume")}, self.prompt)

    def for_decode(self, prefill: Worker | None) -> dict[str, Any]:
        """The body for D: its KV comes from `prefill`, or (None) from where `kv_from` says."""
        host, port = (prefill.host, prefill.bootstrap_port) if prefill else self.kv_from or ("", 0)
        body = {**self.body, "bootstrap_host": host, "bootstrap_port": port}
        if self.ticket is not None:
            body["bootstrap_ticket"] = self.ticket
        return body

    def for_local(self) -> dict[str, Any]:
        """The body for a decode that prefills it itself (the router's fallback): no room."""
        return {k: v for k, v in self.body.items() if k != "bootstrap_room"}

    def for_prefill(self, prefill: Worker) -> dict[str, Any]:
        body = self.for_decode(prefill)
        body.pop("stream_options", None)
        return {**body, "stream": False}


def parse_request(endpoint: str, raw: bytes, content_type: str | None) -> RoutedRequest:
    """The client's body, checked as `baton serve` checks it (a RouterError otherwise), with
    the routing fields added."""
    body = _json_object(raw, content_type)
    for name in ROUTER_ONLY:
        body.pop(name, None)
    parsed = validate(endpoint, body)
    client_rid = body.get("rid") if endpoint == GENERATE else None
    body["rid"] = _rid(endpoint, body)
    if body.get("bootstrap_room") is None:  # a room the client chose is kept as is
        body["bootstrap_room"] = new_rooms(choice_count(endpoint, body))
    hashed = prompt_hash(parsed.model_dump(mode="json", include=set(PROMPT_FIELDS)))
    return RoutedRequest(endpoint, body, parsed, client_rid=client_rid, prompt=hashed)


def parse_abort(raw: bytes, content_type: str | None) -> str:
    """The rid of `POST /abort {"rid": X}`."""
    return parse_model(AbortBody, raw, content_type).rid


def parse_model(model: type[M], raw: bytes, content_type: str | None) -> M:
    """A JSON body read as `model` (a 400 naming the field otherwise)."""
    body = _json_object(raw, content_type)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise rejected(describe_errors(e.errors())) from None


def validate(endpoint: str, body: dict[str, Any]) -> ClientRequest:
    """Check `body` with the worker's request model for `endpoint`, as the worker does."""
    try:
        parsed = MODELS[endpoint].model_validate(body)
        parsed.check()
        return parsed
    except ValidationError as e:
        raise rejected(describe_errors(e.errors())) from None
    except InvalidRequest as e:
        raise rejected(e) from None


def rejected(e: InvalidRequest) -> RouterError:
    return RouterError(e.status, str(e), code=e.code, param=e.field)


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


def _json_object(raw: bytes, content_type: str | None) -> dict[str, Any]:
    try:
        return parse_json_body(raw, content_type)
    except InvalidRequest as e:
        raise rejected(e) from None


def _rid(endpoint: str, body: dict[str, Any]) -> str:
    """The client's rid on /generate, else a fresh one (OpenAI endpoints always get ours)."""
    rid = body.get("rid")
    if endpoint != GENERATE or rid is None:
        return uuid.uuid4().hex
    if not isinstance(rid, str) or not rid:
        raise RouterError(400, "rid must be a non-empty string", param="rid")
    return rid


def prompt_ids(parsed: ClientRequest, tokenizer: Any | None) -> list[int] | None:
    """The token ids the workers will prefill for this request's (first) prompt, tokenized as
    they do it; None when that needs a tokenizer the router has not got, or the chat template
    rejects the messages (the worker will answer that)."""
    if isinstance(parsed, GenerateBody):
        prompt: str | list[int] | None = parsed.text if parsed.text is not None else parsed.input_ids
    elif isinstance(parsed, CompletionRequest):
        prompt = parsed.prompts()[0]
    else:
        if tokenizer is None:
            return None
        try:
            return chat_prompt_ids(tokenizer, [m.flat() for m in parsed.messages])
        except Exception:  # a template may refuse a conversation shape
            return None
    if isinstance(prompt, list):
        return list(prompt)
    return None if prompt is None or tokenizer is None else list(tokenizer.encode(prompt))
