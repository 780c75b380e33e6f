"""Avro single-object encoding (Avro spec 1.11, "Single object encoding") for chatpipe records.

Wire format of every Kafka value chatpipe writes::

    C3 01 | 8-byte little-endian CRC-64-AVRO fingerprint of the writer schema | Avro binary body

The fingerprint names the writer schema without a registry server; the reader looks it up among
all versions in ``schemas/avro`` and resolves it to the newest version of that record (Avro
schema resolution: added fields take their defaults). Anything that is not such a message
raises :class:`~schemas.errors.DecodeError` (or its subclass ``UnknownSchemaError``), never
another exception type, so a consumer can dead-letter it and go on.

Not here: Kafka, topics, headers. A Confluent-registry codec (magic byte + schema id) would be a
second class with the same two methods.
"""

from __future__ import annotations

import dataclasses
import io
import types
import typing
from datetime import datetime, timedelta, timezone
from enum import Enum
from functools import cache
from typing import Any, Callable

from fastavro import schemaless_reader, schemaless_writer
from fastavro.validation import validate

from schemas import records
from schemas.errors import DecodeError, EncodeError, UnknownSchemaError
from schemas.registry import SchemaRegistry, SchemaVersion, default_registry

MARKER = b"\xc3\x01"
HEADER_LEN = len(MARKER) + 8
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MS = timedelta(milliseconds=1)

Converter = Callable[[Any], Any]


# --- dataclass <-> plain dict --------------------------------------------------------------

def _identity(value: Any) -> Any:
    return value


def _to_epoch_ms(value: Any) -> Any:
    # fastavro turns timestamp-millis into aware datetimes on read; records keep epoch ms.
    if isinstance(value, datetime):
        return (value - _EPOCH) // _MS
    return value


def _converter(tp: Any, leaf: Callable[[Any], Converter]) -> Converter:
    """Lift ``leaf`` (a converter for a plain field type) through ``list[...]`` and ``X | None``."""
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        conv = _converter(item, leaf)
        if conv is _identity:
            return _identity
        return lambda values: [conv(v) for v in values]
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        conv = _converter(inner[0], leaf) if len(inner) == 1 else _identity
        if conv is _identity:
            return _identity
        return lambda value: None if value is None else conv(value)
    return leaf(tp)


def _from_avro_leaf(tp: Any) -> Converter:
    """fastavro's value -> typed record value, for one non-container field type."""
    if isinstance(tp, type) and issubclass(tp, Enum):
        return tp
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _record_builder(tp)
    if tp is int:
        return _to_epoch_ms
    return _identity


def _to_avro_leaf(tp: Any) -> Converter:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return to_avro_dict
    return _identity  # StrEnum members are str, which fastavro writes as enum symbols


@cache
def _field_plan(cls: type) -> tuple[tuple[str, Converter, Converter], ...]:
    """Per field: (name, from-avro converter, to-avro converter), computed once per class."""
    hints = typing.get_type_hints(cls)
    plan = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        plan.append((f.name, _converter(tp, _from_avro_leaf), _converter(tp, _to_avro_leaf)))
    return tuple(plan)


def _record_builder(cls: type) -> Converter:
    def build(data: dict) -> Any:
        return cls(**{name: conv(data[name]) for name, conv, _ in _field_plan(cls) if name in data})
    return build


def to_avro_dict(record: Any) -> dict:
    """A record as the plain dict fastavro writes (nested records as dicts)."""
    return {name: conv(getattr(record, name)) for name, _, conv in _field_plan(type(record))}


def from_avro_dict(cls: type, data: dict) -> Any:
    """The typed record ``cls`` from a dict read by fastavro."""
    return _record_builder(cls)(data)


# --- the codec -------------------------------------------------------------------------------

class AvroCodec:
    """Encodes records to single-object-encoded Avro, decodes any known version back.

    ``validate_on_encode`` checks every field against the schema first, turning a wrong type
    into an :class:`EncodeError` that names the field (fastavro alone may write garbage for
    some mismatches); it costs some throughput, so hot paths that build records in code can
    turn it off.
    """

    def __init__(self, registry: SchemaRegistry | None = None, *, validate_on_encode: bool = True):
        self.registry = registry or default_registry()
        self.validate_on_encode = validate_on_encode

    # encode ---------------------------------------------------------------------------------
    def encode(self, record: Any) -> bytes:
        name = type(record).__name__
        if name not in records.RECORD_TYPES:
            raise EncodeError(f"{name} is not a chatpipe record type")
        return self.encode_dict(name, to_avro_dict(record))

    def encode_dict(self, name: str, data: dict, *, version: int | None = None) -> bytes:
        """Encode a plain dict with schema ``name`` (newest, or a given ``version``)."""
        schema = self.registry.latest(name) if version is None else self.registry.version(name, version)
        if self.validate_on_encode:
            try:
                validate(data, schema.parsed, raise_errors=True)
            except Exception as exc:
                raise EncodeError(f"{name} v{schema.version} does not accept this record: {exc}") from exc
        buf = io.BytesIO()
        buf.write(MARKER)
        buf.write(schema.fingerprint)
        try:
            schemaless_writer(buf, schema.parsed, data)
        except Exception as exc:
            raise EncodeError(f"{name} v{schema.version}: {exc}") from exc
        return buf.getvalue()

    # decode ---------------------------------------------------------------------------------
    def writer_schema(self, data: bytes) -> SchemaVersion:
        """The schema version that wrote ``data``, from its header."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise DecodeError(f"expected bytes, got {type(data).__name__}")
        if len(data) < HEADER_LEN:
            raise DecodeError(f"truncated: {len(data)} bytes is shorter than the {HEADER_LEN}-byte header")
        if bytes(data[:2]) != MARKER:
            raise DecodeError(f"not Avro single-object encoding: marker {bytes(data[:2]).hex()} != c301")
        fp = bytes(data[2:HEADER_LEN])
        schema = self.registry.by_fingerprint(fp)
        if schema is None:
            raise UnknownSchemaError(f"unknown schema fingerprint {fp.hex()}")
        return schema

    def decode_dict(self, data: bytes) -> tuple[str, dict]:
        """(record name, newest-version dict) for ``data``."""
        writer = self.writer_schema(data)
        reader = self.registry.latest(writer.name)
        buf = io.BytesIO(data)
        buf.seek(HEADER_LEN)
        try:
            if reader is writer:
                value = schemaless_reader(buf, writer.parsed, None)
            else:
                value = schemaless_reader(buf, writer.parsed, reader.parsed)
        except Exception as exc:  # fastavro raises EOFError, ValueError, IndexError, ... on junk
            raise DecodeError(
                f"corrupt {writer.name} v{writer.version} body: {type(exc).__name__}: {exc}"
            ) from exc
        if buf.tell() != len(data):
            raise DecodeError(
                f"corrupt {writer.name} v{writer.version} body: {len(data) - buf.tell()} trailing bytes"
            )
        if not isinstance(value, dict):
            raise DecodeError(f"{writer.name}: body is not a record")
        return writer.name, value

    def decode(
        self,
        data: bytes,
        expected: type | None = None,
        *,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
    ) -> Any:
        """The typed record in ``data``; ``expected`` checks its type.

        Raises :class:`DecodeError` carrying ``topic``/``partition``/``offset`` when given.
        """
        try:
            name, value = self.decode_dict(data)
            cls = records.RECORD_TYPES[name]
            if expected is not None and cls is not expected:
                raise DecodeError(f"expected {expected.__name__}, got {name}")
            try:
                return from_avro_dict(cls, value)
            except (TypeError, ValueError) as exc:
                raise DecodeError(f"{name}: decoded fields do not fit the record: {exc}") from exc
        except DecodeError as exc:
            if topic is None and partition is None and offset is None:
                raise
            raise exc.at(topic, partition, offset) from exc


@cache
def default_codec() -> AvroCodec:
    return AvroCodec()
