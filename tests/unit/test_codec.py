"""The Avro single-object codec: exact round trips, schema evolution, and only named errors."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import records
from schemas.codec import HEADER_LEN, MARKER, AvroCodec, from_avro_dict
from schemas.errors import DecodeError, EncodeError, UnknownSchemaError
from schemas.registry import SCHEMA_DIR, crc64_fingerprint, default_registry
from tests.samples import sample_records, strategy_for

codec = AvroCodec()


def test_fingerprint_matches_avro_spec_vector():
    """Guards the wire header: CRC-64-AVRO of "null" is 0x63dd24e7cc258f8a (Avro test vectors), little-endian."""
    assert crc64_fingerprint("null") == (0x63DD24E7CC258F8A).to_bytes(8, "little")


@pytest.mark.parametrize("record", sample_records(), ids=lambda r: type(r).__name__)
def test_every_record_type_round_trips(record):
    """A record must decode to exactly what was encoded, with the single-object header in front."""
    data = codec.encode(record)
    assert data[:2] == MARKER
    assert data[2:HEADER_LEN] == default_registry().latest(type(record).__name__).fingerprint
    assert codec.decode(data) == record
    assert codec.decode(data, expected=type(record)) == record


def test_records_match_latest_schemas():
    """Catches a dataclass and its newest .avsc drifting apart (a field added to one only)."""
    for name, cls in records.RECORD_TYPES.items():
        schema = json.loads((SCHEMA_DIR / f"{name}.v{default_registry().latest(name).version}.avsc").read_text())
        assert [f.name for f in fields(cls)] == [f["name"] for f in schema["fields"]], name
        assert cls(**_minimal_kwargs(cls)).schema_version == default_registry().latest(name).version, name


def _minimal_kwargs(cls):
    sample = next(r for r in sample_records() if type(r) is cls)
    return {f.name: getattr(sample, f.name) for f in fields(cls) if f.name != "schema_version"}


def test_old_version_is_read_by_newer_reader():
    """A ConversationTurn written with v1 (no system_prompt, no ttft_ms) must read as v2 with defaults."""
    turn = next(r for r in sample_records() if isinstance(r, records.ConversationTurn))
    from schemas.codec import to_avro_dict

    v1_fields = {f["name"] for f in json.loads((SCHEMA_DIR / "ConversationTurn.v1.avsc").read_text())["fields"]}
    old = {k: v for k, v in to_avro_dict(turn).items() if k in v1_fields}
    old["schema_version"] = 1
    data = codec.encode_dict("ConversationTurn", old, version=1)
    assert data[2:HEADER_LEN] == default_registry().version("ConversationTurn", 1).fingerprint
    decoded = codec.decode(data, expected=records.ConversationTurn)
    assert decoded.system_prompt is None and decoded.ttft_ms == 0.0
    assert decoded.schema_version == 1
    assert (decoded.prompt, decoded.answer, decoded.created_at) == (turn.prompt, turn.answer, turn.created_at)


def test_prompt_request_v1_gets_default_priority():
    """PromptRequest v1 producers predate priorities: their prompts must read as INTERACTIVE."""
    req = next(r for r in sample_records() if isinstance(r, records.PromptRequest))
    from schemas.codec import to_avro_dict

    old = to_avro_dict(req)
    del old["priority"]
    old["schema_version"] = 1
    assert codec.decode(codec.encode_dict("PromptRequest", old, version=1)).priority == records.Priority.INTERACTIVE


def test_named_errors_for_bad_bytes():
    """Each way bytes can be wrong raises DecodeError (never a fastavro/struct exception)."""
    good = codec.encode(sample_records()[0])
    with pytest.raises(DecodeError, match="marker"):
        codec.decode(b"\x00\x01" + good[2:])
    with pytest.raises(DecodeError, match="truncated"):
        codec.decode(good[:5])
    with pytest.raises(DecodeError, match="corrupt"):
        codec.decode(good[:-3])
    with pytest.raises(DecodeError, match="trailing"):
        codec.decode(good + b"\x00")
    with pytest.raises(UnknownSchemaError):
        codec.decode(MARKER + b"\xff" * 8 + good[HEADER_LEN:])
    with pytest.raises(DecodeError, match="expected Feedback"):
        codec.decode(good, expected=records.Feedback)


def test_decode_error_carries_position():
    """A consumer must be able to say where a bad message sits: topic, partition, offset."""
    with pytest.raises(DecodeError) as info:
        codec.decode(b"junk", topic="chat.prompts", partition=3, offset=41)
    assert (info.value.topic, info.value.partition, info.value.offset) == ("chat.prompts", 3, 41)
    assert "chat.prompts" in str(info.value) and "41" in str(info.value)


def test_encode_rejects_wrong_types_with_named_error():
    """A record with a wrong field type must fail loudly at the producer, naming the record."""
    bad = next(r for r in sample_records() if isinstance(r, records.Cancel))
    bad.created_at = "yesterday"
    with pytest.raises(EncodeError, match="Cancel"):
        codec.encode(bad)


_SCHEMAS = [(v.name, v.version, json.loads((SCHEMA_DIR / f"{v.name}.v{v.version}.avsc").read_text()))
            for v in sorted(default_registry().all_versions(), key=lambda v: (v.name, v.version))]


@pytest.mark.parametrize("name,version,schema", _SCHEMAS, ids=[f"{n}.v{v}" for n, v, _ in _SCHEMAS])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_any_valid_record_round_trips(name, version, schema, data):
    """Property: every value the schema admits survives encode -> decode (any version, resolved to newest)."""
    value = data.draw(strategy_for(schema))
    encoded = codec.encode_dict(name, value, version=version)
    decoded_name, decoded = codec.decode_dict(encoded)
    assert decoded_name == name
    record = from_avro_dict(records.RECORD_TYPES[name], decoded)
    if version == default_registry().latest(name).version:
        assert codec.encode(record) == encoded  # byte-identical through the typed record
    else:
        for key in value:  # fields the old version had keep their values
            assert getattr(record, key) == from_avro_dict(records.RECORD_TYPES[name], {**decoded, **value}).__getattribute__(key)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_property_random_bytes_only_raise_decode_error(data):
    """Property: arbitrary bytes decode or raise DecodeError, nothing else (no crash, no hang)."""
    try:
        codec.decode(data)
    except DecodeError:
        pass


_FINGERPRINTS = [v.fingerprint for v in default_registry().all_versions()]


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(_FINGERPRINTS), st.binary(max_size=300))
def test_property_random_body_behind_valid_header_only_raises_decode_error(fingerprint, body):
    """Property: a known header with a garbage body (the hard case for fastavro) raises only DecodeError."""
    try:
        codec.decode(MARKER + fingerprint + body)
    except DecodeError:
        pass
