"""The one msgpack codec for inter-process messages (runtime.messages).

A dataclass travels as a map tagged with its class name; nested message dataclasses (the
ReqOutputs inside a BatchOutput) are tagged too, so decoding rebuilds the same objects. Tuples
come back as lists.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from runtime.messages import MESSAGE_TYPES, Message

_TAG = "__msg__"
_BY_NAME: dict[str, type] = {cls.__name__: cls for cls in MESSAGE_TYPES}


class CodecError(ValueError):
    pass


def _default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        name = type(obj).__name__
        if name not in _BY_NAME:
            raise CodecError(f"{name} is not a registered message type")
        data = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        data[_TAG] = name
        return data
    raise CodecError(f"cannot encode {type(obj).__name__}")


def _object_hook(data: dict[str, Any]) -> Any:
    name = data.pop(_TAG, None)
    if name is None:
        return data
    cls = _BY_NAME.get(name)
    if cls is None:
        raise CodecError(f"unknown message type {name!r}")
    return cls(**data)


def encode(msg: Message) -> bytes:
    return msgpack.packb(msg, default=_default, use_bin_type=True)  # type: ignore[no-any-return]


def decode(raw: bytes) -> Message:
    try:
        msg = msgpack.unpackb(raw, object_hook=_object_hook, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise CodecError(f"undecodable message: {e}") from e
    if not isinstance(msg, MESSAGE_TYPES):
        raise CodecError(f"expected a message, got {type(msg).__name__}")
    return msg  # type: ignore[no-any-return,return-value]
