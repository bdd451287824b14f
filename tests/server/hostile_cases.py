"""Hostile request bodies from issue 12, shared by the server's and the router's tests: each one
must be a 400 (or the status given) whose JSON error names the field in `param`.

Bodies are raw bytes: `raw()` writes lone surrogates as `\\udXXX` escapes and non-finite floats
as NaN / Infinity, exactly as a hostile client would send them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

GEN, COMP, CHAT, ABORT = "/generate", "/v1/completions", "/v1/chat/completions", "/abort"
MODEL = "smollm2"
MSG = [{"role": "user", "content": "hi"}]
JSON_HEADERS = {"content-type": "application/json"}


def raw(body: Any) -> bytes:
    """JSON as a client may send it: lone surrogates escaped, NaN/Infinity as bare words, and
    the string "__1e999__" as the number 1e999 (which overflows to infinity)."""
    text = json.dumps(body, allow_nan=True, ensure_ascii=True)
    return text.replace('"__1e999__"', "1e999").encode()


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: bytes
    param: str | None
    needle: str  # the error message contains this (case-insensitive)
    status: int = 400
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON_HEADERS))
    router: bool = True  # the router rejects it itself (no model or tokenizer needed)


def comp(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MSG, "max_tokens": 2, **kw}


def gen(**sp: Any) -> dict[str, Any]:
    return {"text": "Hi", "sampling_params": {"max_new_tokens": 2, **sp}}


# 1. a lone UTF-16 surrogate in any text field, anywhere
SURROGATES = [
    Case("comp-stop", COMP, raw(comp(stop="\ud800")), "stop", "surrogate"),
    Case("comp-stop-list", COMP, raw(comp(stop=["ok", "\udfff"])), "stop.1", "surrogate"),
    Case("comp-prompt", COMP, raw(comp(prompt="\udc00")), "prompt", "surrogate"),
    Case("comp-prompt-list", COMP, raw(comp(prompt=["a", "b\ud800"])), "prompt.1", "surrogate"),
    Case("comp-user", COMP, raw(comp(user="\ud800")), "user", "surrogate"),
    Case("comp-model", COMP, raw(comp(model="x\ud800")), "model", "surrogate"),
    Case("comp-rid", COMP, raw(comp(rid="\ud800")), "rid", "surrogate"),
    Case("comp-unknown-field", COMP, raw(comp(metadata={"k": "\ud800"})), "metadata.k",
         "surrogate"),
    Case("comp-key", COMP, raw({**comp(), "\ud800": 1}), "\\ud800", "surrogate"),
    Case("chat-content", CHAT, raw(chat(messages=[{"role": "user", "content": "\udc00"}])),
         "messages.0.content", "surrogate"),
    Case("chat-text-part", CHAT,
         raw(chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}])),
         "messages.0.content.0.text", "surrogate"),
    Case("chat-name", CHAT,
         raw(chat(messages=[{"role": "user", "content": "x", "name": "\ud83d"}])),
         "messages.0.name", "surrogate"),
    Case("gen-text", GEN, raw({"text": "Hi \ud800"}), "text", "surrogate"),
    Case("gen-stop", GEN, raw(gen(stop="\ud800")), "sampling_params.stop", "surrogate"),
    Case("gen-rid", GEN, raw({**gen(), "rid": "\ud800"}), "rid", "surrogate"),
    Case("abort-rid", ABORT, raw({"rid": "\ud800"}), "rid", "surrogate"),
]

# 2. NaN / Infinity (and numbers that overflow to infinity) on every endpoint
NON_FINITE = [
    Case("gen-temperature-nan", GEN, raw(gen(temperature=float("nan"))),
         "sampling_params.temperature", "NaN"),
    Case("gen-temperature-inf", GEN, raw(gen(temperature=float("inf"))),
         "sampling_params.temperature", "Infinity"),
    Case("gen-repetition-nan", GEN, raw(gen(repetition_penalty=float("nan"))),
         "sampling_params.repetition_penalty", "NaN"),
    Case("gen-repetition-inf", GEN, raw(gen(repetition_penalty=float("inf"))),
         "sampling_params.repetition_penalty", "Infinity"),
    Case("gen-top-p-minus-inf", GEN, raw(gen(top_p=float("-inf"))), "sampling_params.top_p",
         "-Infinity"),
    Case("gen-min-p-1e999", GEN, raw(gen(min_p="__1e999__")), "sampling_params.min_p", "1e999"),
    Case("comp-temperature-nan", COMP, raw(comp(temperature=float("nan"))), "temperature", "NaN"),
    Case("comp-top-p-1e999", COMP, raw(comp(top_p="__1e999__")), "top_p", "1e999"),
    Case("chat-presence-inf", CHAT, raw(chat(presence_penalty=float("inf"))), "presence_penalty",
         "Infinity"),
    Case("chat-frequency-nan", CHAT, raw(chat(frequency_penalty=float("nan"))),
         "frequency_penalty", "NaN"),
    Case("chat-nan-in-message", CHAT,
         raw(chat(messages=[{"role": "user", "content": float("nan")}])), "messages.0.content",
         "NaN"),
]

# 6. asked for, not supported: a 400 rather than a 200 as if absent
FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {}}}
UNSUPPORTED = [
    Case("chat-tools", CHAT, raw(chat(tools=[FUNCTION])), "tools", "not supported"),
    Case("chat-tool-choice", CHAT, raw(chat(tool_choice="required")), "tool_choice",
         "not supported"),
    Case("chat-functions", CHAT, raw(chat(functions=[FUNCTION["function"]])), "functions",
         "not supported"),
    Case("chat-function-call", CHAT, raw(chat(function_call="auto")), "function_call",
         "not supported"),
    Case("chat-json-object", CHAT, raw(chat(response_format={"type": "json_object"})),
         "response_format", "not supported"),
    Case("chat-json-schema", CHAT,
         raw(chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}})),
         "response_format", "not supported"),
    Case("comp-best-of", COMP, raw(comp(best_of=3)), "best_of", "not supported"),
    Case("comp-suffix", COMP, raw(comp(suffix="!")), "suffix", "not supported"),
    Case("chat-top-logprobs-alone", CHAT, raw(chat(top_logprobs=2)), "top_logprobs",
         "logprobs"),
    Case("chat-stream-options-no-stream", CHAT,
         raw(chat(stream_options={"include_usage": True})), "stream_options", "stream"),
    Case("comp-stream-options-no-stream", COMP,
         raw(comp(stream=False, stream_options={"include_usage": True})), "stream_options",
         "stream"),
    Case("comp-logit-bias-key", COMP, raw(comp(logit_bias={"abc": 1})), "logit_bias", "token id"),
    Case("comp-logit-bias-range", COMP, raw(comp(logit_bias={"5": 101})), "logit_bias", "100"),
    Case("gen-logit-bias-range", GEN, raw(gen(logit_bias={"5": -300})),
         "sampling_params.logit_bias", "100"),
    Case("comp-logit-bias-vocab", COMP, raw(comp(logit_bias={"999999": 1})), "logit_bias",
         "vocab", router=False),
]

# Harmless values of the same fields are accepted (they ask for nothing we do not do).
HARMLESS = [
    (CHAT, chat(tools=[], tool_choice="none", response_format={"type": "text"})),
    (CHAT, chat(functions=[], function_call="none", logprobs=True, top_logprobs=0)),
    (COMP, comp(best_of=1, suffix="")),
    (COMP, comp(suffix=None, stream=True, stream_options={"include_usage": True})),
]

# 7. prompt + max_tokens beyond the context window (8192 tokens for SmolLM2)
CONTEXT = [
    Case("comp-max-tokens", COMP, raw(comp(max_tokens=9000)), "max_tokens",
         "maximum context length is 8192 tokens", router=False),
    Case("chat-max-completion-tokens", CHAT,
         raw(chat(max_tokens=None, max_completion_tokens=9000)), "max_completion_tokens",
         "maximum context length is 8192 tokens", router=False),
    Case("gen-max-new-tokens", GEN, raw(gen(max_new_tokens=9000)),
         "sampling_params.max_new_tokens", "maximum context length is 8192 tokens", router=False),
]

# 8. a JSON body without `Content-Type: application/json`
CONTENT_TYPE = [
    Case("form-encoded", COMP, raw(comp()), None, "application/json", 415,
         {"content-type": "application/x-www-form-urlencoded"}),
    Case("no-content-type", CHAT, raw(chat()), None, "application/json", 415, {}),
    Case("text-plain", GEN, raw(gen()), None, "application/json", 415,
         {"content-type": "text/plain"}),
    Case("abort-form", ABORT, raw({"rid": "x"}), None, "application/json", 415,
         {"content-type": "application/x-www-form-urlencoded"}),
]

ALL = SURROGATES + NON_FINITE + UNSUPPORTED + CONTEXT + CONTENT_TYPE


def ids(cases: list[Case]) -> list[str]:
    return [c.name for c in cases]


# ---- the same, fuzzed (hypothesis): what no OpenAPI schema describes ---------------------------
# Valid bodies with every kind of string and number field; one leaf (or a new key, or a value
# wrapped in a list or an object) is replaced by a lone UTF-16 surrogate or a non-finite number.
BASES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"model": "smollm2", "prompt": ["Hi", "there"], "max_tokens": 2,
                         "stop": ["x", "y"], "user": "u", "temperature": 0.5, "top_p": 0.9,
                         "seed": 3, "logit_bias": {"5": 1.5}, "rid": "r", "suffix": ""}),
    ("/v1/chat/completions", {
        "model": "smollm2", "max_tokens": 2, "stop": "x", "presence_penalty": 0.1,
        "frequency_penalty": 0.1, "response_format": {"type": "text"}, "tool_choice": "none",
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "n"}]}),
    ("/generate", {"text": "Hi", "rid": "g", "bootstrap_host": "h", "sampling_params": {
        "max_new_tokens": 2, "temperature": 0.7, "stop": ["a"], "repetition_penalty": 1.1,
        "min_p": 0.1, "top_k": 5}}),
    ("/abort", {"rid": "x"}),
]
LITERALS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]
_MARK = "__non_finite_{}__"


def _locations(value: Any, loc: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a body: its leaves and containers (the body itself is ())."""
    found = [loc]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _locations(item, (*loc, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += _locations(item, (*loc, i))
    return found


def _put(body: Any, loc: tuple[Any, ...], value: Any) -> None:
    for step in loc[:-1]:
        body = body[step]
    body[loc[-1]] = value


def _dotted(loc: tuple[Any, ...]) -> str:
    return ".".join(str(x).encode("utf-8", "backslashreplace").decode() for x in loc)


@st.composite
def hostile_bodies(draw: st.DrawFn) -> tuple[str, bytes, str, str]:
    """(path, raw JSON body, the param the 400 must name, a word its message must hold)."""
    path, base = draw(st.sampled_from(BASES))
    body = json.loads(json.dumps(base))
    where = draw(st.sampled_from(_locations(body)))
    surrogate = draw(st.integers(0xD800, 0xDFFF).map(chr))
    target: Any = body
    for step in where:
        target = target[step]
    if draw(st.booleans()) and isinstance(target, dict):  # a new key, or a key that is bad
        if draw(st.booleans()):
            key = draw(st.text(max_size=3)) + surrogate
            target[key] = 1
            return path, _raw(body), _dotted((*where, key)), "surrogate"
        where = (*where, "extra")
    elif not where:
        where = ("extra",)
    if draw(st.booleans()):
        bad: Any = draw(st.text(max_size=4)) + surrogate + draw(st.text(max_size=4))
        needle = "surrogate"
    else:
        needle = draw(st.sampled_from(LITERALS))
        bad = _MARK.format(LITERALS.index(needle))
    wrap = draw(st.sampled_from(["bare", "list", "object"]))
    if wrap == "list":
        bad = [bad]
        param_loc = (*where, 0)
    elif wrap == "object":
        bad = {"k": bad}
        param_loc = (*where, "k")
    else:
        param_loc = where
    _put(body, where, bad)
    return path, _raw(body), _dotted(param_loc), needle


def _raw(body: Any) -> bytes:
    text = json.dumps(body, ensure_ascii=True)
    for i, literal in enumerate(LITERALS):
        text = text.replace(f'"{_MARK.format(i)}"', literal)
    return text.encode()


def check_hostile(client: httpx.Client, path: str, raw: bytes, param: str, needle: str) -> None:
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, (path, raw[:300], r.status_code, r.text[:300])
    assert r.headers.get("connection") != "close", r.headers
    error = r.json()["error"]
    assert error["param"] == param, (raw[:300], error)
    assert needle.lower() in error["message"].lower(), error


HOSTILE_SETTINGS = settings(max_examples=200, derandomize=True, deadline=None, database=None,
                            suppress_health_check=list(HealthCheck), phases=[Phase.generate])
