"""Pydantic request models: OpenAI completions / chat completions and the native /generate.

Strict types (no "5" for 5), bounded integers (everything that crosses to the scheduler fits an
int64), and the OpenAI field names; sglang's sampling extras are accepted alongside. What types
cannot say is in each model's `check()`: OpenAI fields we do not implement are a 400 naming them
(not a 200 as if absent), and pairs of fields that only make sense together.
Torch-free: `baton router` validates with these same models before it fans a request out.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from runtime.handover import Bootstrap
from runtime.sampling_params import SamplingParams
from runtime.validation import InvalidRequest

INT64_MAX = (1 << 63) - 1
MAX_TOKENS_LIMIT = (1 << 31) - 1

def _integral(value: Any) -> Any:
    """JSON has one number type: 3.0 is the integer 3 (JSON Schema agrees); 3.5 stays an error."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


_INTEGRAL = BeforeValidator(_integral)
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT), _INTEGRAL]
Seed = Annotated[int, Field(ge=-INT64_MAX, le=INT64_MAX), _INTEGRAL]
Room = Annotated[int, Field(ge=0, le=INT64_MAX), _INTEGRAL]  # 63-bit, drawn by the router
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT), _INTEGRAL]
Stop = str | Annotated[list[str], Field(max_length=16)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class Resume(_Strict):
    """A stream the router moves to another pair mid-way (docs/router.md "Migration"): the
    tokens its client already has, and how many characters of their text it was sent."""

    output_ids: Annotated[list[TokenId], Field(max_length=1 << 20)]
    text_chars: Annotated[int, Field(ge=0), _INTEGRAL] = 0


# what decides a request's prompt tokens, in any endpoint's body, but for the router's `resume`
PROMPT_FIELDS = frozenset({"text", "input_ids", "prompt", "messages"})


def _sha256(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def prompt_hash(fields: Mapping[str, Any]) -> str:
    """sha256 of a body's PROMPT_FIELDS as JSON (absent and null alike left out)."""
    return _sha256({k: fields[k] for k in sorted(PROMPT_FIELDS) if fields.get(k) is not None})


def prompt_digest(fields: Mapping[str, Any], hashed: str | None = None) -> str:
    """What a room ticket binds a request's prompt by: its prompt_hash (`hashed`, if the caller
    has it already) and its `resume`. The router signs it from the request it parsed, and each
    worker computes it from the request it parsed with the same model, so a ticket admits one
    prompt only."""
    return _sha256([hashed or prompt_hash(fields), fields.get("resume")])


class BootstrapFields(_Strict):
    """What `baton router` adds to a request for a prefill/decode pair (docs/disaggregation.md "Wire contract"):
    the request id, the prefill's bootstrap address and one room per choice; to resume a stream,
    what it already produced; to follow a stream's tokens, `return_token_ids`; to let a draining
    decode move it, `allow_kv_move`."""

    rid: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    bootstrap_host: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    bootstrap_port: Annotated[int, Field(ge=1, le=65535), _INTEGRAL] | None = None
    bootstrap_room: Room | Annotated[list[Room], Field(min_length=1, max_length=256)] | None = None
    bootstrap_ticket: Annotated[str, Field(max_length=4096)] | None = None  # runtime/auth/ticket.py
    resume: Resume | None = None  # continue after these output tokens (one choice only)
    return_token_ids: bool = False  # OpenAI streams: each chunk's choice carries `token_ids`
    # a one-choice stream whose client follows it (a router): a draining decode may move it,
    # KV and all, to another decode, ending it with where it went (docs/router.md "Migration")
    allow_kv_move: bool = False
    # the prefix cache's namespace (vLLM's and sglang's field): KV is shared only among requests
    # of one salt; a router with API keys sets it per key (runtime/router/tenants.py)
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    def prompt_digest(self) -> str:
        return prompt_digest(self.model_dump(mode="json", include={*PROMPT_FIELDS, "resume"}))

    def rooms(self, role: str, choices: int) -> list[int | None]:
        """One bootstrap room per choice; a 400 when a prefill/decode server lacks them."""
        room = self.bootstrap_room
        if role != "colocated" and (room is None or not self.bootstrap_host
                                    or self.bootstrap_port is None):
            raise InvalidRequest(
                f"a {role} server needs bootstrap_host, bootstrap_port and bootstrap_room "
                "(send requests through `baton router`)", "bootstrap_room")
        if room is None:
            return [None] * choices
        rooms = [room] if isinstance(room, int) else list(room)
        if len(rooms) != choices:
            raise InvalidRequest(f"bootstrap_room: give {choices} room(s), one per choice; got "
                                 f"{len(rooms)}", "bootstrap_room")
        repeated = sorted({r for r in rooms if rooms.count(r) > 1})
        if repeated:
            raise InvalidRequest(f"bootstrap_room: each choice needs a room of its own; "
                                 f"{', '.join(map(str, repeated))} repeated", "bootstrap_room")
        return list(rooms)

    def bootstrap(self, room: int | None) -> Bootstrap | None:
        """The frozen pairing one choice carries on (its `room`, from `rooms`)."""
        if room is None:
            return None
        return Bootstrap(room, self.bootstrap_host, self.bootstrap_port, self.bootstrap_ticket)


class SamplingFields(BootstrapFields):
    """Fields shared by both OpenAI endpoints."""

    model: str
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=16), _INTEGRAL] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    user: str | None = None
    # sglang extras
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOKENS_LIMIT), _INTEGRAL] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    skip_special_tokens: bool | None = None
    stream_interval: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT), _INTEGRAL] | None = None
    logit_bias: dict[str, Any] | None = None  # checked by SamplingParams (token id -> bias)

    # max_tokens absent or null: this many (clipped to what fits): sglang's default, 128
    DEFAULT_MAX_TOKENS: ClassVar[int] = SamplingParams.max_new_tokens
    # OpenAI fields we do not implement: field -> "this value asks for nothing" (else a 400)
    UNSUPPORTED: ClassVar[dict[str, tuple[Callable[[Any, Any], bool], str]]] = {}

    def check(self) -> None:
        """What the types cannot say; raises InvalidRequest naming the field."""
        for name, (harmless, why) in self.UNSUPPORTED.items():
            if not harmless(getattr(self, name), self):
                raise InvalidRequest(f"not supported: {name} ({why})", name)
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true",
                                 "stream_options")
        if self.logit_bias:
            _sampling_params({"logit_bias": self.logit_bias}, prefix="")

    def sampling_params(self, max_new_tokens: int | None, seed_offset: int) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "stop": self.stop,
            "seed": None if self.seed is None else _wrap_int64(self.seed + seed_offset),
        }
        for name in (
            "temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
            "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens",
            "stream_interval", "logit_bias",
        ):
            params[name] = getattr(self, name)
        return {k: v for k, v in params.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _wrap_int64(x: int) -> int:
    return (x + INT64_MAX + 1) % (1 << 64) - INT64_MAX - 1


def _sampling_params(raw: dict[str, Any] | None, prefix: str) -> SamplingParams:
    """SamplingParams.from_dict, its error's field under `prefix` ("sampling_params.")."""
    try:
        return SamplingParams.from_dict(raw)
    except InvalidRequest as e:
        field = f"{prefix}{e.field}" if e.field else prefix.rstrip(".") or None
        raise InvalidRequest(str(e), field, e.status) from None


def _absent(value: Any, _: Any = None) -> bool:
    return value is None or value == [] or value == "none"


Prompt = (
    Annotated[str, Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=16)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=16)]
)


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: MaxTokens | None = None  # None (absent or null): DEFAULT_MAX_TOKENS
    logprobs: Annotated[int, Field(ge=0, le=20), _INTEGRAL] | None = None
    echo: bool = False
    best_of: Any = None
    suffix: Any = None

    DEFAULT_MAX_TOKENS: ClassVar[int] = 16  # OpenAI's documented default
    UNSUPPORTED: ClassVar[dict[str, tuple[Callable[[Any, Any], bool], str]]] = {
        "best_of": (lambda v, r: v is None or v == r.n, "every choice generated is returned"),
        "suffix": (lambda v, _: v is None or v == "", "no text insertion"),
        "echo": (lambda v, _: v is False, "the prompt is not echoed"),
    }

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=64)] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: Any = None

    def check(self, where: str) -> None:
        """OpenAI's rules per role: every role but an assistant's needs content; a tool's
        message answers a tool call (`tool_call_id`), which no other role carries; only an
        assistant's message has tool_calls, which this server does not produce."""
        if self.content is None and self.role != "assistant":
            raise InvalidRequest(f"a {self.role} message needs content", f"{where}.content")
        if self.role == "tool" and not self.tool_call_id:
            raise InvalidRequest("a tool message needs tool_call_id", f"{where}.tool_call_id")
        if self.role != "tool" and self.tool_call_id is not None:
            raise InvalidRequest(f"a {self.role} message has no tool_call_id", f"{where}.tool_call_id")
        if self.tool_calls is not None and self.role != "assistant":
            raise InvalidRequest(f"a {self.role} message has no tool_calls", f"{where}.tool_calls")
        if self.tool_calls not in (None, []):
            raise InvalidRequest("this server does not call tools: no tool_calls",
                                 f"{where}.tool_calls")
        if self.role == "assistant" and self.content is None:
            raise InvalidRequest("an assistant message without tool_calls needs content",
                                 f"{where}.content")

    def flat(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=256)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20), _INTEGRAL] | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None

    UNSUPPORTED: ClassVar[dict[str, tuple[Callable[[Any, Any], bool], str]]] = {
        name: (_absent, "this server does not call tools or functions")
        for name in ("tools", "tool_choice", "functions", "function_call")
    } | {"response_format": (lambda v, _: v is None or v == {"type": "text"},
                             'only {"type": "text"}: no JSON mode or schema yet')}

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
        for i, message in enumerate(self.messages):
            message.check(f"messages.{i}")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class GenerateBody(BootstrapFields):
    """Native /generate: one prompt as `text` or `input_ids`, sglang's sampling_params."""

    text: str | None = None
    input_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: Annotated[int, Field(ge=0, le=20), _INTEGRAL] = 0

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateBody:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of `text` or `input_ids`")
        return self

    def check(self) -> SamplingParams:
        """The sampling params, validated (errors name `sampling_params.FIELD`)."""
        try:
            check_int64(self.sampling_params or {}, "sampling_params")
        except ValueError as e:
            raise InvalidRequest(str(e), "sampling_params") from None
        return _sampling_params(self.sampling_params, prefix="sampling_params.")


class AbortBody(_Strict):
    rid: Annotated[str, Field(min_length=1, max_length=256)]


def check_int64(value: Any, where: str) -> None:
    """Every integer that crosses to the scheduler must fit an int64 (msgpack, torch)."""
    if isinstance(value, bool):
        return
    if isinstance(value, int) and not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ValueError(f"{where}: integer out of range")
    if isinstance(value, dict):
        for k, v in value.items():
            check_int64(v, f"{where}.{k}")
    elif isinstance(value, list | tuple):
        for v in value:
            check_int64(v, where)
