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

import io
from functools import cache
from typing import Any, Callable

from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.validation import validate

from schemas import records
from schemas.converters import compile_reader, compile_record, from_avro_dict, to_avro_dict
from schemas.errors import DecodeError, EncodeError, SchemaError, UnknownSchemaError
from schemas.registry import SchemaRegistry, SchemaVersion, default_registry

__all__ = ["MARKER", "HEADER_LEN", "AvroCodec", "default_codec", "to_avro_dict", "from_avro_dict"]

MARKER = b"\xc3\x01"
HEADER_LEN = len(MARKER) + 8
_BytesIO = io.BytesIO  # one global lookup instead of two, per message (encode)


def _without_timestamp_types(schema: Any) -> Any:
    """A copy of a parsed schema whose ``timestamp-millis`` longs are plain longs.

    The bytes are the same (a logical type only changes the value fastavro hands out); records
    keep epoch ms, so reading them as ints skips a datetime round trip per timestamp.
    """
    if isinstance(schema, list):
        return [_without_timestamp_types(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    # drop fastavro's "__fastavro_parsed"/"__named_schemas" marks: the copy is parsed afresh
    out = {k: _without_timestamp_types(v) for k, v in schema.items() if not k.startswith("__")}
    if out.get("type") == "long" and out.get("logicalType") == "timestamp-millis":
        return "long"
    return out


class _RecordPlan:
    """Everything the hot path needs for one schema version, looked up once by fingerprint."""

    __slots__ = ("version", "header", "cls", "plain", "latest_plain", "encoder", "decoder", "read", "broken")

    def __init__(self, version: SchemaVersion, cls: type | None) -> None:
        self.version = version
        self.header = MARKER + version.fingerprint
        self.cls = cls  # the dataclass of the newest version of this record; None if this build has none
        # the writer schema, timestamps as plain longs
        self.plain: Any = parse_schema(_without_timestamp_types(version.parsed))
        self.latest_plain: Any = None  # the newest version's, or None when this is it (no resolution)
        self.encoder: Callable[[Any], dict] | None = None  # only on the newest version's plan
        self.decoder: Callable[[dict], Any] | None = None  # builds the newest dataclass
        self.read: Callable[[bytes], Any] | None = None  # bytes -> record, None on trailing bytes
        self.broken = ""  # why the dataclass and the schema could not be lined up, if they could not


# The fast path's reading, in front of the compiled decoder (schemas.converters.compile_reader).
_READ_PROLOGUE = (
    "buf = _BytesIO(data)",
    "buf.seek(_HEADER_LEN)",
    "d = _read(buf, _writer, _reader)",
    "if buf.tell() != len(data):",
    "    return None  # trailing bytes: the checked path names them",
)

Plans = tuple[dict[bytes, _RecordPlan], dict[bytes, _RecordPlan], dict[type, _RecordPlan]]


@cache
def _plans_for(registry: SchemaRegistry) -> Plans:
    """The plans of every schema version ``registry`` holds, built (and converters compiled) once
    per registry: (by fingerprint, by marker + fingerprint for decodable ones, by record class)."""
    plans: dict[bytes, _RecordPlan] = {}
    by_header: dict[bytes, _RecordPlan] = {}
    encode_plans: dict[type, _RecordPlan] = {}
    for name in registry.names():
        latest = registry.latest(name)
        cls = records.RECORD_TYPES.get(name)
        newest = _RecordPlan(latest, cls)
        if cls is not None:
            try:
                newest.encoder, newest.decoder = compile_record(cls, newest.plain)
            except SchemaError as exc:  # a record and its .avsc out of step: fail that type only
                newest.broken = str(exc)
            encode_plans[cls] = newest
        for version in [v for v in registry.all_versions() if v.name == name]:
            plan = newest
            if version is not latest:
                plan = _RecordPlan(version, cls)
                plan.latest_plain, plan.decoder, plan.broken = newest.plain, newest.decoder, newest.broken
            plans[version.fingerprint] = plan
            if plan.decoder is not None:
                plan.read = compile_reader(cls, newest.plain, "data", _READ_PROLOGUE, {
                    "_BytesIO": io.BytesIO, "_read": schemaless_reader, "_HEADER_LEN": HEADER_LEN,
                    "_writer": plan.plain, "_reader": plan.latest_plain})
                by_header[plan.header] = plan
    return plans, by_header, encode_plans


class AvroCodec:
    """Encodes records to single-object-encoded Avro, decodes any known version back.

    ``encode(record)`` always checks the record: a compiled per-type converter checks inline
    the mismatches fastavro would write silently, fastavro raises on the rest, and only then
    (on the failure path) fastavro's validator runs to name the field in an :class:`EncodeError`.
    ``validate_on_encode`` applies to ``encode_dict`` (plain dicts have no compiled checks);
    turning it off there skips the validator for dicts built in code.
    """

    def __init__(self, registry: SchemaRegistry | None = None, *, validate_on_encode: bool = True):
        self.registry = registry or default_registry()
        self.validate_on_encode = validate_on_encode
        self._plans, self._by_header, self._encode_plans = _plans_for(self.registry)

    def parsed_schema(self, cls: type) -> Any:
        """The fastavro-parsed schema ``encode`` writes ``cls`` with and ``decode`` reads it with
        (timestamps as plain longs): what ``bench/kafka_io.py`` runs raw fastavro with."""
        plan = self._encode_plans.get(cls)
        if plan is None:
            raise EncodeError(f"{cls!r} is not a chatpipe record type with a schema")
        return plan.plain

    # encode ---------------------------------------------------------------------------------
    def encode(self, record: Any) -> bytes:
        plan = self._encode_plans.get(type(record))
        if plan is None:
            cls = type(record)
            if records.RECORD_TYPES.get(cls.__name__) is not cls:
                raise EncodeError(f"{cls.__module__}.{cls.__qualname__} is not a chatpipe record type")
            raise EncodeError(f"{cls.__name__}: no schema of that name among {self.registry.names()}")
        if plan.encoder is None:
            raise EncodeError(f"{plan.version.name}: cannot encode, {plan.broken}")
        buf = _BytesIO()
        buf.write(plan.header)
        try:
            schemaless_writer(buf, plan.plain, plan.encoder(record))
        except Exception:  # noqa: BLE001 - NotExact, or fastavro refusing a value: the slow path names the culprit
            return self._encode_checked(plan.version, record)
        return buf.getvalue()

    def _encode_checked(self, schema: SchemaVersion, record: Any) -> bytes:
        """The slow path: the generic conversion, fastavro's validator, then the write."""
        try:
            data = to_avro_dict(record)
        except Exception as exc:  # e.g. a nested field that is neither a record nor a dict
            raise EncodeError(f"{schema.name} v{schema.version} does not accept this record: "
                              f"{type(exc).__name__}: {exc}") from exc
        return self._write(schema, data, check=True)

    def encode_dict(self, name: str, data: dict, *, version: int | None = None) -> bytes:
        """Encode a plain dict with schema ``name`` (newest, or a given ``version``)."""
        schema = self.registry.latest(name) if version is None else self.registry.version(name, version)
        return self._write(schema, data, check=self.validate_on_encode)

    def _write(self, schema: SchemaVersion, data: dict, *, check: bool) -> bytes:
        if check:
            try:
                validate(data, schema.parsed, raise_errors=True)
            except Exception as exc:
                raise EncodeError(f"{schema.name} v{schema.version} does not accept this record: {exc}") from exc
        buf = io.BytesIO()
        buf.write(MARKER + schema.fingerprint)
        try:
            schemaless_writer(buf, schema.parsed, data)
        except Exception as exc:
            raise EncodeError(f"{schema.name} v{schema.version}: {exc}") from exc
        return buf.getvalue()

    # decode ---------------------------------------------------------------------------------
    def _plan(self, data: bytes) -> _RecordPlan:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise DecodeError(f"expected bytes, got {type(data).__name__}")
        if len(data) < HEADER_LEN:
            raise DecodeError(f"truncated: {len(data)} bytes is shorter than the {HEADER_LEN}-byte header")
        if bytes(data[:2]) != MARKER:
            raise DecodeError(f"not Avro single-object encoding: marker {bytes(data[:2]).hex()} != c301")
        fp = bytes(data[2:HEADER_LEN])
        plan = self._plans.get(fp)
        if plan is None:
            raise UnknownSchemaError(f"unknown schema fingerprint {fp.hex()}")
        return plan

    def _read(self, plan: _RecordPlan, data: bytes, writer: Any, reader: Any) -> dict:
        buf = io.BytesIO(data)
        buf.seek(HEADER_LEN)
        version = plan.version
        try:
            value = schemaless_reader(buf, writer, reader)
        except Exception as exc:  # fastavro raises EOFError, ValueError, IndexError, ... on junk
            raise DecodeError(f"corrupt {version.name} v{version.version} body: {type(exc).__name__}: {exc}") from exc
        if buf.tell() != len(data):
            raise DecodeError(f"corrupt {version.name} v{version.version} body: "
                              f"{len(data) - buf.tell()} trailing bytes")
        if not isinstance(value, dict):
            raise DecodeError(f"{version.name}: body is not a record")
        return value

    def decode_dict(self, data: bytes) -> tuple[str, dict]:
        """(record name, newest-version dict) for ``data``, as fastavro reads it (timestamps as datetimes)."""
        plan = self._plan(data)
        latest = self.registry.latest(plan.version.name)
        reader = None if latest is plan.version else latest.parsed
        return plan.version.name, self._read(plan, data, plan.version.parsed, reader)

    def decode(self, data: bytes, expected: type | None = None, *, topic: str | None = None,
               partition: int | None = None, offset: int | None = None) -> Any:
        """The typed record in ``data``; ``expected`` checks its type.

        Raises :class:`DecodeError` carrying ``topic``/``partition``/``offset`` when given.
        """
        # Fast path for the common case, a well-formed message of a known type; anything
        # unusual falls through to _decode_checked, which repeats the steps with a check and a
        # named error at each one (so no error is swallowed here, only re-derived).
        plan = self._by_header.get(data[:HEADER_LEN]) if type(data) is bytes else None
        if plan is not None and (expected is None or plan.cls is expected):
            try:
                record = plan.read(data)
                if record is not None:
                    return record
            except Exception:  # noqa: BLE001 - re-derived with its named error just below
                pass
        try:
            return self._decode_checked(data, expected)
        except DecodeError as exc:
            if topic is None and partition is None and offset is None:
                raise
            raise exc.at(topic, partition, offset) from exc

    def _decode_checked(self, data: bytes, expected: type | None) -> Any:
        plan = self._plan(data)
        if expected is not None and plan.cls is not expected:
            raise DecodeError(f"expected {expected.__name__}, got {plan.version.name}")
        if plan.decoder is None:
            raise DecodeError(f"{plan.version.name}: no record type for it in this build {plan.broken}")
        value = self._read(plan, data, plan.plain, plan.latest_plain)
        try:
            return plan.decoder(value)
        except Exception as exc:  # e.g. an enum symbol the record's enum lacks
            raise DecodeError(f"{plan.version.name}: decoded fields do not fit the record: "
                              f"{type(exc).__name__}: {exc}") from exc


@cache
def default_codec() -> AvroCodec:
    return AvroCodec()
