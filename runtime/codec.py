"""The one msgpack codec for messages between processes.

A dataclass travels as a map tagged with its class name; nested message dataclasses (the
ReqOutputs inside a BatchOutput) are tagged too, so decoding rebuilds the same objects. Tuples
come back as lists. `encode`/`decode` carry runtime.messages (HTTP <-> scheduler process);
`Codec(types)` builds the same for another channel's message set (disagg.wire).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from runtime.messages import MESSAGE_TYPES, Message

_TAG = "__msg__"


class CodecError(ValueError):
    pass


class Codec:
    def __init__(self, types: tuple[type, ...]) -> None:
        self.types = types
        self._by_name: dict[str, type] = {cls.__name__: cls for cls in types}

    def _default(self, obj: Any) -> Any:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            name = type(obj).__name__
            if name not in self._by_name:
                raise CodecError(f"{name} is not a registered message type")
            data = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
            data[_TAG] = name
            return data
        raise CodecError(f"cannot encode {type(obj).__name__}")

    def _object_hook(self, data: dict[str, Any]) -> Any:
        name = data.pop(_TAG, None)
        if name is None:
            return data
        cls = self._by_name.get(name)
        if cls is None:
            raise CodecError(f"unknown message type {name!r}")
        try:
            return cls(**data)
        except TypeError as e:
            raise CodecError(f"bad {name}: {e}") from e

    def encode(self, msg: Any) -> bytes:
        return msgpack.packb(msg, default=self._default, use_bin_type=True)  # type: ignore[no-any-return]

    def decode(self, raw: bytes) -> Any:
        try:
            msg = msgpack.unpackb(
                raw, object_hook=self._object_hook, raw=False, strict_map_key=False
            )
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise CodecError(f"undecodable message: {e}") from e
        if not isinstance(msg, self.types):
            raise CodecError(f"expected a message, got {type(msg).__name__}")
        return msg


_MESSAGES = Codec(MESSAGE_TYPES)


def encode(msg: Message) -> bytes:
    return _MESSAGES.encode(msg)


def decode(raw: bytes) -> Message:
    return _MESSAGES.decode(raw)  # type: ignore[no-any-return]
