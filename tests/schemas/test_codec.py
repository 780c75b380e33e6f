"""The Avro single-object codec: exact round trips, schema evolution, and only named errors."""

from __future__ import annotations

import json
from dataclasses import fields, is_dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import records
from schemas.codec import HEADER_LEN, MARKER, AvroCodec, from_avro_dict, to_avro_dict
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
    assert decoded.system_prompt is None and decoded.ttft_ms == 0.0 and decoded.trace_id is None
    assert decoded.schema_version == 1
    assert (decoded.prompt, decoded.answer, decoded.created_at) == (turn.prompt, turn.answer, turn.created_at)


def test_turn_keeps_its_trace_id_and_v2_turns_read_without_one():
    """Lineage (ConversationTurn v3): the trace id written with a turn reads back exactly, and a turn
    written with v2 (before trace ids) still decodes, as a turn without a trace (None), everything
    else intact; v3 with no trace (a turn recorded without a span) reads as None too."""
    from dataclasses import replace

    turn = next(r for r in sample_records() if isinstance(r, records.ConversationTurn))
    assert turn.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736" and turn.schema_version == 5
    data = codec.encode(turn)
    assert data[2:HEADER_LEN] == default_registry().version("ConversationTurn", 5).fingerprint
    assert codec.decode(data, expected=records.ConversationTurn).trace_id == turn.trace_id
    assert codec.decode(codec.encode(replace(turn, trace_id=None))).trace_id is None

    v2_fields = {f["name"] for f in json.loads((SCHEMA_DIR / "ConversationTurn.v2.avsc").read_text())["fields"]}
    assert "trace_id" not in v2_fields
    old = {k: v for k, v in to_avro_dict(turn).items() if k in v2_fields} | {"schema_version": 2}
    data = codec.encode_dict("ConversationTurn", old, version=2)
    assert data[2:HEADER_LEN] == default_registry().version("ConversationTurn", 2).fingerprint
    decoded = codec.decode(data, expected=records.ConversationTurn)
    assert decoded == replace(turn, trace_id=None, schema_version=2)


def test_turn_v4_says_whether_memory_keeps_it_and_older_turns_read_as_not_kept_by_the_writer():
    """ConversationTurn v4: ``remembered`` and ``memory_degraded`` read back as written; a v3 turn reads
    both False (its record agent had upserted it itself: the memory writer must not do it again)."""
    from dataclasses import replace

    turn = replace(next(r for r in sample_records() if isinstance(r, records.ConversationTurn)),
                   remembered=True, memory_degraded=True)
    decoded = codec.decode(codec.encode(turn), expected=records.ConversationTurn)
    assert decoded.remembered and decoded.memory_degraded
    v3_fields = {f["name"] for f in json.loads((SCHEMA_DIR / "ConversationTurn.v3.avsc").read_text())["fields"]}
    old = {k: v for k, v in to_avro_dict(turn).items() if k in v3_fields} | {"schema_version": 3}
    decoded = codec.decode(codec.encode_dict("ConversationTurn", old, version=3), expected=records.ConversationTurn)
    assert decoded == replace(turn, remembered=False, memory_degraded=False, schema_version=3)


def test_cache_fields_round_trip_and_older_versions_read_as_computed_by_a_worker():
    """TokenChunk v4, Response v3, ConversationTurn v5: ``cached_tokens`` and ``response_cached`` read back as
    written; a record of the version before reads 0 / False (a worker computed it, cache unknown).
    PromptRequest v7 ``response_cache``: a v6 prompt reads True (the cache may answer it)."""
    from dataclasses import replace

    older = {"TokenChunk": 3, "Response": 2, "ConversationTurn": 4}
    samples = {type(r).__name__: r for r in sample_records()}
    for name, version in older.items():
        record = replace(samples[name], cached_tokens=17, response_cached=True)
        decoded = codec.decode(codec.encode(record), expected=type(record))
        assert (decoded.cached_tokens, decoded.response_cached) == (17, True)
        old_fields = {f["name"] for f in json.loads((SCHEMA_DIR / f"{name}.v{version}.avsc").read_text())["fields"]}
        old = {k: v for k, v in to_avro_dict(record).items() if k in old_fields} | {"schema_version": version}
        decoded = codec.decode(codec.encode_dict(name, old, version=version), expected=type(record))
        zero = None if name == "TokenChunk" else 0
        assert (decoded.cached_tokens, decoded.response_cached, decoded.schema_version) == (zero, False, version)
    prompt = replace(samples["PromptRequest"], response_cache=False)
    assert codec.decode(codec.encode(prompt), expected=records.PromptRequest).response_cache is False
    v6_fields = {f["name"] for f in json.loads((SCHEMA_DIR / "PromptRequest.v6.avsc").read_text())["fields"]}
    old = {k: v for k, v in to_avro_dict(prompt).items() if k in v6_fields} | {"schema_version": 6}
    assert codec.decode(codec.encode_dict("PromptRequest", old, version=6)).response_cache is True


def test_prompt_request_memory_off_round_trips_and_a_v7_prompt_reads_as_memory_on():
    """PromptRequest v8 ``memory``: False (a batch line naming no conversation) reads back False; a prompt of
    a v7 writer reads True (memory as before)."""
    from dataclasses import replace

    prompt = replace(next(r for r in sample_records() if isinstance(r, records.PromptRequest)), memory=False)
    assert codec.decode(codec.encode(prompt), expected=records.PromptRequest).memory is False
    v7_fields = {f["name"] for f in json.loads((SCHEMA_DIR / "PromptRequest.v7.avsc").read_text())["fields"]}
    old = {k: v for k, v in to_avro_dict(prompt).items() if k in v7_fields} | {"schema_version": 7}
    assert codec.decode(codec.encode_dict("PromptRequest", old, version=7)).memory is True


def test_prompt_request_v1_gets_default_priority():
    """PromptRequest v1 producers predate priorities: their prompts must read as INTERACTIVE."""
    req = next(r for r in sample_records() if isinstance(r, records.PromptRequest))
    from schemas.codec import to_avro_dict

    old = to_avro_dict(req)
    del old["priority"]
    old["schema_version"] = 1
    assert codec.decode(codec.encode_dict("PromptRequest", old, version=1)).priority == records.Priority.INTERACTIVE


@pytest.mark.parametrize("name, old_version", [("PromptRequest", 2), ("InferenceRequest", 1)])
def test_requests_without_deadline_read_as_no_deadline(name, old_version):
    """Producers of the versions before deadlines (PromptRequest v2, InferenceRequest v1) must still be
    read, as requests without a deadline (None), not rejected or given a deadline of 0 (= expired)."""
    from schemas.codec import to_avro_dict

    req = next(r for r in sample_records() if type(r).__name__ == name)
    old = {k: v for k, v in to_avro_dict(req).items() if k != "deadline_at"}
    old["schema_version"] = old_version
    decoded = codec.decode(codec.encode_dict(name, old, version=old_version))
    assert decoded.deadline_at is None and decoded.request_id == req.request_id
    with_deadline = codec.decode(codec.encode(type(req)(**{**_fields(req), "deadline_at": 1_700_000_000_123})))
    assert with_deadline.deadline_at == 1_700_000_000_123


def _fields(record) -> dict:
    return {f.name: getattr(record, f.name) for f in fields(record)}


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


# --- the compiled fast path (schemas/converters.py) must check exactly as much as validation did ---

def _prompt(**changes):
    """The sample PromptRequest (with fixed id and time, so two calls are equal), fields changed by path."""
    req = next(r for r in sample_records() if isinstance(r, records.PromptRequest))
    req.request_id, req.created_at = "req-fixed", 1_700_000_000_000
    for path, value in changes.items():
        target = req
        *parents, name = path.split("__")
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, name, value)
    return req


@pytest.mark.parametrize("path,value", [
    ("created_at", "yesterday"),      # fastavro raises: the error must still name the field
    ("created_at", True),             # the rest fastavro would write silently, as 1, 1, True, ...
    ("sampling__max_tokens", 1.5),
    ("sampling__max_tokens", 2**40),  # outside Avro int (32-bit)
    ("reply_partition", 2**31),
    ("stream", 1),
    ("sampling__stop", "\n\n"),       # a str where an array goes would be written char by char
    ("sampling__temperature", True),
    ("messages", ["just a string"]),
    ("priority", "URGENT"),
    ("tenant", None),
])
def test_wrong_field_raises_encode_error_naming_it(path, value):
    """A wrong-typed field must raise EncodeError naming the field, never write bytes that decode to
    something else (the compiled encoder skips the separate validation pass, not the checks)."""
    with pytest.raises(EncodeError, match=path.split("__")[-1]) as info:
        codec.encode(_prompt(**{path: value}))
    assert "PromptRequest" in str(info.value)


def test_values_fastavro_accepts_still_encode_like_their_canonical_form():
    """An int in a double field and a datetime in a timestamp field take the slow path but must
    give the same bytes as the canonical values (no needless EncodeError)."""
    from datetime import datetime, timezone

    canonical = _prompt(**{"sampling__temperature": 1.0, "created_at": 1_700_000_000_000})
    loose = _prompt(**{"sampling__temperature": 1,
                       "created_at": datetime.fromtimestamp(1_700_000_000, tz=timezone.utc)})
    assert codec.encode(loose) == codec.encode(canonical)
    assert codec.decode(codec.encode(loose)) == canonical


def test_encode_rejects_objects_that_are_not_records():
    """Encoding something that is not one of schemas.records' classes is a named error."""
    with pytest.raises(EncodeError, match="not a chatpipe record type"):
        codec.encode({"request_id": "r"})


def test_decode_accepts_bytearray_and_memoryview():
    """Values from other clients may come as bytearray/memoryview: the checked path must read them."""
    record = sample_records()[0]
    data = codec.encode(record)
    assert codec.decode(bytearray(data)) == record
    assert codec.decode(memoryview(data)) == record


def test_dataclass_and_schema_out_of_step_is_a_schema_error():
    """A record and its .avsc drifting apart must fail loudly when the converters are built."""
    from dataclasses import dataclass

    from schemas.converters import compile_record
    from schemas.errors import SchemaError

    @dataclass(slots=True)
    class Cancel:  # a drifted copy of records.Cancel, one field short
        request_id: str
        conversation_id: str

    with pytest.raises(SchemaError, match="do not match"):
        compile_record(Cancel, default_registry().latest("Cancel").parsed)


def test_symbol_unknown_to_the_record_enum_is_a_decode_error(tmp_path):
    """A newer schema with an enum symbol our StrEnum lacks must raise DecodeError, not KeyError."""
    import shutil

    from schemas.registry import SchemaRegistry

    for path in SCHEMA_DIR.glob("*.avsc"):
        shutil.copy(path, tmp_path)
    latest = default_registry().latest("PromptRequest").version
    newer_schema = json.loads((SCHEMA_DIR / f"PromptRequest.v{latest}.avsc").read_text())
    priority = next(f for f in newer_schema["fields"] if f["name"] == "priority")
    priority["type"]["symbols"].append("BULK")
    (tmp_path / f"PromptRequest.v{latest + 1}.avsc").write_text(json.dumps(newer_schema))
    newer = AvroCodec(SchemaRegistry(tmp_path))
    data = newer.encode_dict("PromptRequest", {**to_avro_dict(_prompt()), "priority": "BULK"})
    with pytest.raises(DecodeError, match="BULK"):
        newer.decode(data)
    assert newer.decode(newer.encode(_prompt())) == _prompt()


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_property_mutated_message_decodes_or_raises_decode_error(data):
    """Property: flipping bytes of a valid message's body gives a record or DecodeError, nothing else."""
    good = bytearray(codec.encode(_prompt()))
    for _ in range(data.draw(st.integers(1, 4))):
        index = data.draw(st.integers(HEADER_LEN, len(good) - 1))
        good[index] = data.draw(st.integers(0, 255))
    try:
        assert isinstance(codec.decode(bytes(good)), records.PromptRequest)
    except DecodeError:
        pass


def _as_list(value):
    return value if isinstance(value, list) else [value]


_PALETTE = [None, True, False, 0, 1, -1, 2**31, 2**63, 1.5, 2.0, "", "x", "STOP", b"", b"x", [], ["x"], [1],
            [True], {}, {"role": "user", "content": "x"}, records.ChatMessage("user", "x"), records.Priority.BATCH]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sample_records()), st.data())
def test_property_fast_encode_agrees_with_validate_then_write(record, data):
    """Property: for any field set to any of many wrong or odd values, encode() raises EncodeError
    exactly when fastavro's validator rejects the record, and otherwise writes the validated bytes."""
    import copy

    from fastavro import schemaless_writer
    from fastavro.validation import validate

    record = copy.deepcopy(record)
    nested = [v for f in fields(record) for v in _as_list(getattr(record, f.name)) if is_dataclass(v)]
    target = data.draw(st.sampled_from([record, *nested]))  # a top-level or a nested record's field
    name = data.draw(st.sampled_from([f.name for f in fields(target)]))
    setattr(target, name, data.draw(st.sampled_from(_PALETTE)))
    schema = default_registry().latest(type(record).__name__)
    try:
        as_dict = to_avro_dict(record)
        valid = validate(as_dict, schema.parsed, raise_errors=False)
    except Exception:  # noqa: BLE001 - not even convertible: must be an EncodeError below
        valid = False
    if not valid:
        with pytest.raises(EncodeError):
            codec.encode(record)
        return
    import io

    buf = io.BytesIO()
    try:
        schemaless_writer(buf, schema.parsed, as_dict)
    except Exception:  # noqa: BLE001 - valid per the validator yet unwritable: must be an EncodeError
        with pytest.raises(EncodeError):
            codec.encode(record)
        return
    assert codec.encode(record) == MARKER + schema.fingerprint + buf.getvalue()


def test_a_failed_worker_status_round_trips_and_v1_statuses_still_read():
    """WorkerStatus v2 adds FAILED (a worker that stopped consuming must never look SERVING); heartbeats
    written with v1 still read. The v2 enum names STOPPED as its default, so readers of a later
    version with more symbols read STOPPED, not an error."""
    from schemas.codec import to_avro_dict

    status = records.WorkerStatus(worker_id="w1", model="m", state=records.WorkerState.FAILED, running=0, waiting=0,
                                  kv_cache_used_tokens=0, kv_cache_total_tokens=1, tokens_per_s=0.0)
    assert codec.decode(codec.encode(status)).state is records.WorkerState.FAILED
    old = {**to_avro_dict(status), "state": "SERVING", "schema_version": 1}
    decoded = codec.decode(codec.encode_dict("WorkerStatus", old, version=1))
    assert decoded.state is records.WorkerState.SERVING and decoded.schema_version == 1
    v2 = json.loads((SCHEMA_DIR / "WorkerStatus.v2.avsc").read_text())
    enum = next(f["type"] for f in v2["fields"] if f["name"] == "state")
    assert enum["symbols"][-1] == "FAILED" and enum["default"] == "STOPPED"


def test_worker_status_v3_carries_the_load_in_tokens_and_v2_reports_read_as_unknown():
    """v3 adds what the gateway's wait estimate needs (transport/fleet.py); a v2 worker's report reads with
    0 for each, which the estimate takes as "not reported" (it admits rather than guess)."""
    from schemas.codec import to_avro_dict

    status = records.WorkerStatus(worker_id="w1", model="m", state=records.WorkerState.SERVING, running=8, waiting=3,
                                  kv_cache_used_tokens=0, kv_cache_total_tokens=1, tokens_per_s=40.0, max_running=8,
                                  queued_prompt_tokens=90, queued_output_tokens=300, running_output_tokens=200,
                                  decode_tokens_per_s=55.5, prefill_tokens_per_s=900.0)
    assert codec.decode(codec.encode(status)) == status
    v2 = {k: v for k, v in to_avro_dict(status).items() if k not in {
        "max_running", "queued_prompt_tokens", "queued_output_tokens", "running_output_tokens",
        "decode_tokens_per_s", "prefill_tokens_per_s"}}
    old = codec.decode(codec.encode_dict("WorkerStatus", {**v2, "schema_version": 2}, version=2))
    assert (old.max_running, old.queued_output_tokens, old.decode_tokens_per_s, old.schema_version) == (0, 0, 0.0, 2)
