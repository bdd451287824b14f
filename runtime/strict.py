"""Strict dataclasses for what crosses a trust boundary (KV frames, bootstrap bodies).

`check_types(obj)` checks every field of a dataclass instance against its annotation, the way
msgpack or JSON can deliver it: `int` is an int and not a bool, `float` takes an int too,
`list[int]` is a list of ints, `X | None`, `dict[str, Any]`, nested dataclasses, `Any`. A
mismatch is a TypeError naming the field (`RoomRequest.dst_pages[3]: expected int, got str`),
so `Cls(**untrusted)` in a `__post_init__` that calls it either builds a well-typed object or
raises; `in_range` does the same for bounds. Torch-free, stdlib only.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

INT64_MAX = (1 << 63) - 1


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def check_types(obj: Any) -> None:
    """Raise TypeError unless every field of dataclass `obj` matches its annotation."""
    cls = type(obj)
    hints = _hints(cls)
    for f in dataclasses.fields(obj):
        _check(getattr(obj, f.name), hints[f.name], f"{cls.__name__}.{f.name}")


def _check(value: Any, hint: Any, where: str) -> None:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                _check(value, option, where)
                return
            except TypeError:
                continue
        raise TypeError(f"{where}: expected {_name(hint)}, got {type(value).__name__}")
    if origin is list:
        _expect(value, list, where, hint)
        for i, item in enumerate(value):
            _check(item, args[0], f"{where}[{i}]")
    elif origin is dict:
        _expect(value, dict, where, hint)
        for k, v in value.items():
            _check(k, args[0], f"{where} key")
            _check(v, args[1], f"{where}[{k!r}]")
    elif hint is type(None):
        if value is not None:
            raise TypeError(f"{where}: expected None, got {type(value).__name__}")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{where}: expected float, got {type(value).__name__}")
    else:
        _expect(value, hint, where, hint)


def _expect(value: Any, cls: type, where: str, hint: Any) -> None:
    if (isinstance(value, bool) and cls is not bool) or not isinstance(value, cls):
        raise TypeError(f"{where}: expected {_name(hint)}, got {type(value).__name__}")


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def in_range(where: str, value: int | float, low: int | float, high: int | float) -> None:
    """Raise ValueError unless low <= value <= high."""
    if not low <= value <= high:
        raise ValueError(f"{where}: {value} is outside [{low}, {high}]")


def short_text(where: str, value: str, most: int, least: int = 0) -> None:
    """Raise ValueError unless `value` has between `least` and `most` characters."""
    if not least <= len(value) <= most:
        raise ValueError(f"{where}: {len(value)} characters, expected {least}..{most}")
