"""SamplingParams: sglang's names, validated once at the door with errors that name the field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from runtime.validation import InvalidRequest, check_values

__all__ = ["InvalidRequest", "SamplingParams"]

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's bound on one token's bias


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    stream_interval: int | None = None  # None: the server's --stream-interval
    # (token id, bias) pairs added to the logits before sampling (OpenAI `logit_bias`)
    logit_bias: tuple[tuple[int, float], ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> SamplingParams:
        raw = dict(raw or {})
        check_values(raw)  # NaN, Infinity, lone surrogates: a 400 naming the field
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {', '.join(unknown)}", unknown[0])
        kwargs: dict[str, Any] = {}
        for name, value in raw.items():
            if value is None and name not in ("seed", "stream_interval"):
                continue
            kwargs[name] = _coerce(name, value)
        params = cls(**kwargs)
        params.validate()
        return params

    def validate(self) -> None:
        def bad(name: str, why: str) -> InvalidRequest:
            return InvalidRequest(f"{name} {why}, got {getattr(self, name)!r}", name)

        if self.max_new_tokens < 1:
            raise bad("max_new_tokens", "must be >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise bad("top_k", "must be -1 (off) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise bad("stream_interval", "must be >= 1")
        if any(not s for s in self.stop):
            raise bad("stop", "must not contain empty strings")


_INT_FIELDS = {"max_new_tokens", "top_k", "seed", "stream_interval"}
_FLOAT_FIELDS = {
    "temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
}
_BOOL_FIELDS = {"ignore_eos", "skip_special_tokens"}


def _coerce(name: str, value: Any) -> Any:
    if name in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise InvalidRequest(f"{name} must be a boolean, got {value!r}", name)
        return value
    if name in _INT_FIELDS:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidRequest(f"{name} must be an integer, got {value!r}", name)
        return value
    if name in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequest(f"{name} must be a number, got {value!r}", name)
        return float(value)
    if name == "stop":
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not all(isinstance(s, str) for s in items):
            raise InvalidRequest(f"stop must be a string or a list of strings, got {value!r}", name)
        return tuple(items)
    if name == "logit_bias":
        return _logit_bias(value)
    if name == "stop_token_ids":
        if not isinstance(value, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
        ):
            raise InvalidRequest(f"stop_token_ids must be a list of token ids, got {value!r}", name)
        return tuple(value)
    return value


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` (JSON keys are strings) as sorted (id, bias) pairs."""
    if not isinstance(value, dict):
        raise InvalidRequest(f"logit_bias must map token ids to numbers, got {value!r}",
                             "logit_bias")
    pairs = []
    for key, bias in value.items():
        token = _token_id(key)
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not (
                -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT):
            raise InvalidRequest(f"logit_bias[{key!r}] must be a number in [-100, 100], "
                                 f"got {bias!r}", "logit_bias")
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs))


def _token_id(key: Any) -> int:
    if isinstance(key, str) and key.isascii() and key.isdigit():
        key = int(key)
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 1 << 31:
        raise InvalidRequest(f"logit_bias keys must be token ids (non-negative integers), "
                             f"got {key!r}", "logit_bias")
    return key
