"""Raw Kafka messages -> typed rows of one record type, all schema versions.

Values are Avro single-object encoded (``C3 01`` + 8-byte CRC-64-AVRO fingerprint + body).
spark-avro's ``from_avro`` decodes a body given its writer schema, and resolves it to a
reader schema (option ``avroSchema``: Avro schema resolution, added fields take defaults).
So each message is decoded in the JVM by one ``CASE fingerprint WHEN fp_v1 THEN
from_avro(body, v1, reader=latest) WHEN fp_v2 THEN ... END``: one pass, no Python worker,
every known version of the record, one output struct. The alternative, a pandas/Arrow UDF
calling fastavro per row, ships every value through a Python worker; bench/finetune.py prints
the decode step's records/s against ``codec.decode`` in one Python process.

Drop reasons (step ``decode``): ``null_value``, ``not_single_object_encoding`` (marker is not
C3 01 or message shorter than the header), ``unknown_schema`` (fingerprint not in
``schemas/avro``), ``wrong_record_type`` (a known schema of another record, e.g. a Feedback on
chat.turns), ``corrupt_body`` (from_avro could not read the body, the body has bytes after the
record, or a string is not valid UTF-8). The raw bytes of a dropped message are not copied to
the output (they cannot be redacted); topic/partition/offset point at them.

Same verdict as the Python codec (``schemas.codec``), message by message (tested over fuzzed
cases). ``from_avro`` alone is more lenient in two ways, both closed here:

- It stops after the record and ignores what follows; the codec rejects trailing bytes. Spark
  SQL cannot ask the decoder where it stopped, so the body is decoded with one more field,
  ``bytes`` at the end of both schemas, fed ``body + encode(bytes: sha256(message))``: the
  field reads back as the message's own hash only when the record ended exactly where the
  body did. To pass with trailing bytes T, T + sentinel would have to begin with the sentinel:
  T would hold the first bytes of a hash of the message that contains T (or the hash would be
  33 bytes of one period), a SHA-256 fixed point; so the check is exact in practice. Re-encoding
  (``to_avro``) and comparing lengths is not: both decoders accept non-canonical varints, which
  re-encode shorter.
- Spark's strings are UTF-8 bytes taken as they are; fastavro decodes them strictly. Every
  string of the record is checked with ``is_valid_utf8``.

Not here: anything about the text (redaction comes next).
"""

from __future__ import annotations

import json

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.avro.functions import from_avro

from schemas.codec import HEADER_LEN, MARKER
from schemas.registry import SchemaRegistry, default_registry
from spark_jobs.steps import StepResult, as_dropped, first_reason, is_live, tag, untagged


def _schema_json(version) -> str:
    from schemas.registry import SCHEMA_DIR

    return json.dumps(json.loads((SCHEMA_DIR / f"{version.name}.v{version.version}.avsc").read_text()))


def decode_records(raw: DataFrame, record: str, registry: SchemaRegistry | None = None) -> StepResult:
    """Decode ``raw`` (sources.RAW_SCHEMA) as ``record``; kept rows hold its newest-version fields.

    Kept columns: every field of the newest schema (timestamps as epoch ms, enums as strings),
    ``writer_version``, ``source_topic``, ``source_partition``, ``source_offset``, ``kafka_ts``.
    """
    tagged, fields = _decode(raw, record, registry)
    kept = tagged.where(is_live()).select(*fields, *_POSITION)
    # Dropped rows from the frame before the record's fields are pulled out: a record may have
    # fields named like the Kafka position columns (DeadLetter.source_topic).
    return StepResult(kept, as_dropped(tagged.where(~is_live()), None, record))


def decode_tagged(raw: DataFrame, record: str, registry: SchemaRegistry | None = None) -> DataFrame:
    """Every message of ``raw`` decoded as ``record``, tagged (``steps.tag``) with its decode drop reason.

    Columns: those of :func:`decode_records`' kept rows plus ``_step``/``_reason``/``_detail``; a
    dropped message has null record fields (its raw bytes are not copied, see the module doc).
    """
    tagged, fields = _decode(raw, record, registry)
    return tagged.select(*fields, *_POSITION, "_step", "_reason", "_detail")


_POSITION = ("writer_version", "source_topic", "source_partition", "source_offset", "kafka_ts")


#: The field appended to writer and reader schema to find where the record ends (module doc).
END_FIELD = "_chatpipe_end"
_END_MARK = bytearray([0x40])  # zigzag varint of 32: the sentinel's length, 32 bytes of SHA-256


def _with_end_field(version) -> str:
    schema = json.loads(_schema_json(version))
    schema["fields"] = [*schema["fields"], {"name": END_FIELD, "type": "bytes"}]
    return json.dumps(schema)


def _has_strings(avro_type) -> bool:
    if isinstance(avro_type, list):
        return any(_has_strings(t) for t in avro_type)
    kind = avro_type.get("type") if isinstance(avro_type, dict) else avro_type
    if kind == "record":
        return any(_has_strings(f["type"]) for f in avro_type["fields"])
    return kind in ("string", "map") or (kind == "array" and _has_strings(avro_type["items"]))


def _strings_valid(col: Column, avro_type) -> Column:
    """True when every string inside ``col`` (of Avro type ``avro_type``, with strings) is valid UTF-8."""
    if isinstance(avro_type, list):  # a nullable type: Spark gives the one non-null branch
        branches = [t for t in avro_type if t != "null" and _has_strings(t)]
        return col.isNull() | _strings_valid(col, branches[0]) if len(branches) == 1 else F.lit(True)
    kind = avro_type.get("type") if isinstance(avro_type, dict) else avro_type
    if kind == "string":
        return F.is_valid_utf8(col)
    if kind == "record":
        out = F.lit(True)
        for f in avro_type["fields"]:
            if _has_strings(f["type"]):
                out = out & _strings_valid(col[f["name"]], f["type"])
        return out
    if kind == "array":
        return F.forall(col, lambda x: _strings_valid(x, avro_type["items"]))
    if kind == "map":
        values = avro_type["values"]
        keys = F.forall(F.map_keys(col), F.is_valid_utf8)
        return keys & F.forall(F.map_values(col), lambda x: _strings_valid(x, values)) if _has_strings(values) else keys
    return F.lit(True)


def _decode(raw: DataFrame, record: str, registry: SchemaRegistry | None):
    """(raw rows tagged with their decode drop reason, the record's field Columns, null when dropped)."""
    registry = registry or default_registry()
    latest = registry.latest(record)
    versions = sorted((v for v in registry.all_versions() if v.name == record), key=lambda v: v.version)
    reader_json = _with_end_field(latest)
    known_fps = [bytearray(v.fingerprint) for v in registry.all_versions()]

    fp = F.substring("value", 3, 8)
    digest = F.unhex(F.sha2(F.col("value"), 256))
    # body + the encoded sentinel field (module doc: where the record ends)
    body = F.concat(F.expr(f"substring(value, {HEADER_LEN + 1}, 2147483647)"), F.lit(_END_MARK), digest)
    decoded = None
    version = None
    for v in versions:
        cond = fp == F.lit(bytearray(v.fingerprint))
        value = from_avro(body, _with_end_field(v), {"mode": "PERMISSIVE", "avroSchema": reader_json})
        decoded = F.when(cond, value) if decoded is None else decoded.when(cond, value)
        version = F.when(cond, F.lit(v.version)) if version is None else version.when(cond, F.lit(v.version))

    df = raw.select(
        F.col("topic").alias("source_topic"), F.col("partition").alias("source_partition"),
        F.col("offset").alias("source_offset"), F.col("timestamp").alias("kafka_ts"),
        "value", decoded.alias("_rec"), version.alias("writer_version"),
    )
    # PERMISSIVE from_avro turns an unreadable body into a struct of nulls (or null): a field
    # the schema says is never null tells them apart.
    required = next(f["name"] for f in latest.parsed["fields"] if not isinstance(f["type"], list))
    reason = first_reason(
        (F.col("value").isNull(), "null_value"),
        ((F.length("value") < HEADER_LEN) | (F.substring("value", 1, 2) != F.lit(bytearray(MARKER))),
         "not_single_object_encoding"),
        (~fp.isin(*known_fps), "unknown_schema"),
        (F.col("writer_version").isNull(), "wrong_record_type"),
        (F.col("_rec").isNull() | F.col(f"_rec.{required}").isNull()
         | ~F.coalesce(F.col(f"_rec.{END_FIELD}") == digest, F.lit(False))
         | ~F.coalesce(_strings_valid(F.col("_rec"), json.loads(_schema_json(latest))), F.lit(True)),
         "corrupt_body"),
    )
    detail = F.when(F.col("value").isNotNull(), F.concat(F.lit("fingerprint="), F.hex(fp)))
    tagged = tag(untagged(df), "decode", reason, detail)

    fields = []
    for f in latest.parsed["fields"]:
        col = F.when(is_live(), F.col(f"_rec.{f['name']}"))
        ftype = f["type"]
        if isinstance(ftype, dict) and ftype.get("logicalType") == "timestamp-millis":
            col = F.unix_millis(col)
        fields.append(col.alias(f["name"]))
    return tagged, fields
