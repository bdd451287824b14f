"""Checks at the front doors (`baton serve` and `baton router`), shared so both answer alike.

Torch-free and FastAPI-free: the router imports it. A request body is read by `parse_json_body`
before any model sees it: JSON only (by Content-Type), an object, every number finite and every
string valid Unicode (no lone UTF-16 surrogates, which no tokenizer, codec or response can carry),
each problem a 4xx naming the field as `param` ("messages.0.content").
"""

from __future__ import annotations

import email.message
import json
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any


class InvalidRequest(ValueError):
    """Bad input from a client. `field` names the offending parameter; servers map it to a 4xx
    (`status`: 400, 409 for a bootstrap room already in use, 415 for a body that is not JSON)."""

    def __init__(self, message: str, field: str | None = None, status: int = 400,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.status = status
        self._code = code

    @property
    def code(self) -> str:
        if self._code is not None:
            return self._code
        return "room_in_use" if self.status == 409 else "invalid_request"


_SURROGATE = re.compile("[\ud800-\udfff]")


def safe_text(text: str) -> str:
    """`text` with any lone surrogate written as `\\udXXX`, so it can be encoded as UTF-8."""
    if _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# pydantic names the member of a union it tried inside an error's location ("str",
# "list[function-before[_integral(), constrained-int]]"...): no client field
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def field_path(loc: Iterable[object]) -> str | None:
    """("messages", 0, "content") -> "messages.0.content"; None for the body itself. pydantic's
    union-member tags are left out: the client sees its own field names only."""
    parts = [safe_text(str(x)) for x in loc if x != "body" and not _type_tag(x)]
    return ".".join(parts) or None


def _type_tag(part: object) -> bool:
    return isinstance(part, str) and (
        part in _TYPE_TAGS or "[" in part or part.startswith(("function-", "constrained-")))


class _NonFinite:
    """What the JSON parser returns for NaN, Infinity, -Infinity and numbers like 1e999."""

    def __init__(self, literal: str) -> None:
        self.literal = literal


def _parse_float(literal: str) -> float | _NonFinite:
    value = float(literal)
    return value if math.isfinite(value) else _NonFinite(literal)


def is_json_content_type(content_type: str | None) -> bool:
    """application/json, or any application/*+json, parameters (charset) allowed."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json"))


def parse_json_body(raw: bytes, content_type: str | None) -> dict[str, Any]:
    """The request body as a JSON object, or InvalidRequest (415 if it is not sent as JSON)."""
    if not is_json_content_type(content_type):
        got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        raise InvalidRequest(
            f"the body must be JSON sent with Content-Type: application/json (got {got})",
            status=415, code="unsupported_media_type")
    if not raw.strip():
        raise InvalidRequest("malformed JSON body: it is empty; send a JSON object",
                             code="json_invalid")
    try:
        body = json.loads(raw, parse_constant=_NonFinite, parse_float=_parse_float)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, too deep
        raise InvalidRequest(f"malformed JSON body: {e}", code="json_invalid") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"the body must be a JSON object, not {_json_type(body)}",
                             code="json_invalid")
    check_values(body)
    return body


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def check_values(body: Any) -> None:
    """Raise InvalidRequest at the first non-finite number or lone surrogate (keys included),
    naming where it is. Iterative: a body may nest as deep as the JSON parser allowed."""
    stack: list[tuple[Any, tuple[object, ...]]] = [(body, ())]
    while stack:
        value, loc = stack.pop()
        if isinstance(value, str):
            _check_text(value, loc)
        elif isinstance(value, _NonFinite | float):
            _check_number(value, loc)
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                _check_text(key, (*loc, key))
                stack.append((item, (*loc, key)))
        elif isinstance(value, list):
            stack.extend((item, (*loc, i)) for i, item in reversed(list(enumerate(value))))


def _check_text(text: str, loc: Sequence[object]) -> None:
    found = _SURROGATE.search(text)
    if found is not None:
        where = field_path(loc) or "body"
        raise InvalidRequest(
            f"{where}: a lone UTF-16 surrogate (\\u{ord(found.group()):04x} at character "
            f"{found.start()}) is not valid Unicode text", where)


def _check_number(value: _NonFinite | float, loc: Sequence[object]) -> None:
    if isinstance(value, _NonFinite):
        where = field_path(loc) or "body"
        literal = value.literal
        kind = "is not valid JSON" if literal in ("NaN", "Infinity", "-Infinity") else (
            "overflows to infinity")
        raise InvalidRequest(f"{where}: {literal} {kind}; numbers must be finite", where,
                             code="json_invalid")
    if not math.isfinite(value):  # a body built in Python rather than parsed
        where = field_path(loc) or "body"
        raise InvalidRequest(f"{where}: {value} is not a finite number", where)


def describe_errors(errors: Sequence[Any]) -> InvalidRequest:
    """A 400 from pydantic's errors (`ValidationError.errors()`, or FastAPI's, whose locations
    start with "body"): up to five problems, `param` the first one's field."""
    parts: list[str] = []
    for e in errors:
        part = f"{field_path(e.get('loc', ())) or 'body'}: {e.get('msg', 'invalid')}"
        if part not in parts:  # a union's members often fail alike
            parts.append(part)
    parts = parts[:5]
    param = field_path(errors[0].get("loc", ())) if errors else None
    return InvalidRequest(safe_text("; ".join(parts)) or "invalid request", param)


def context_overflow(prompt_tokens: int, max_new: int, context_len: int, field: str,
                     prompt_field: str = "prompt") -> InvalidRequest | None:
    """vLLM's answer when the prompt plus the tokens asked for do not fit the context window."""
    total = prompt_tokens + max_new
    if total <= context_len:
        return None
    return InvalidRequest(
        f"This model's maximum context length is {context_len} tokens; you requested {total} "
        f"tokens ({prompt_tokens} in the {prompt_field} + {max_new} for the completion). "
        f"Reduce the {prompt_field} or {field}.",
        field if prompt_tokens < context_len else prompt_field, code="context_length_exceeded")
