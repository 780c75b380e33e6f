"""Records and Kafka messages as JSON-ready dicts, for ``chatpipe tail``.

Rules, so a line can be read back without knowing the schema: timestamps stay int epoch
milliseconds, enums become their symbol strings, ``bytes`` fields (``DeadLetter.key/value``,
``Header.value``) become base64 strings. Kafka keys and header values are UTF-8 text by contract
(ids, ``traceparent``); one that is not valid UTF-8 is given as base64 under a ``*_base64`` name
instead, so nothing is dropped or mangled.

No I/O and no Kafka client here: the input is anything with the ``ConsumedMessage`` properties.
"""

from __future__ import annotations

import base64
import dataclasses
from enum import Enum
from typing import Any, Protocol


class MessageLike(Protocol):
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    timestamp_ms: int


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def to_jsonable(obj: Any) -> Any:
    """``obj`` (a record dataclass, or anything inside one) as plain JSON types."""
    if obj is None or isinstance(obj, (bool, int, float)):
        return obj
    if isinstance(obj, Enum):  # before str: StrEnum is a str too, but the symbol is what we want
        return obj.value
    if isinstance(obj, str):
        return obj
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return b64(bytes(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    raise TypeError(f"no JSON form for {type(obj).__name__}")  # a record type this module does not know


def _text_or_b64(name: str, data: bytes | None) -> dict[str, Any]:
    if data is None:
        return {name: None}
    try:
        return {name: data.decode("utf-8")}
    except UnicodeDecodeError:
        return {f"{name}_base64": b64(data)}


def envelope(message: MessageLike) -> dict[str, Any]:
    """Where a message sits and what it carries besides its value."""
    return {
        "topic": message.topic,
        "partition": message.partition,
        "offset": message.offset,
        **_text_or_b64("key", message.key),
        "timestamp": message.timestamp_ms,
        "headers": [{"key": k, **_text_or_b64("value", v)} for k, v in message.headers],
    }


def decoded_line(message: MessageLike, record: Any) -> dict[str, Any]:
    """The JSON line of a message whose value decoded to ``record`` (None for a tombstone)."""
    return {**envelope(message), "type": None if record is None else type(record).__name__,
            "value": to_jsonable(record)}


def error_line(message: MessageLike, reason: str) -> dict[str, Any]:
    """The JSON line of a message whose value did not decode: the reason and the raw bytes."""
    value = message.value
    return {**envelope(message), "error": reason, "value_base64": None if value is None else b64(value)}
