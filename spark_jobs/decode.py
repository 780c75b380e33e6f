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
chat.turns), ``corrupt_body`` (from_avro could not read the body). The raw bytes of a dropped
message are not copied to the output (they cannot be redacted); topic/partition/offset point
at them.

Not here: anything about the text (redaction comes next).
"""

from __future__ import annotations

import json

from pyspark.sql import DataFrame
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


def _decode(raw: DataFrame, record: str, registry: SchemaRegistry | None):
    """(raw rows tagged with their decode drop reason, the record's field Columns, null when dropped)."""
    registry = registry or default_registry()
    latest = registry.latest(record)
    versions = sorted((v for v in registry.all_versions() if v.name == record), key=lambda v: v.version)
    reader_json = _schema_json(latest)
    known_fps = [bytearray(v.fingerprint) for v in registry.all_versions()]

    fp = F.substring("value", 3, 8)
    body = F.expr(f"substring(value, {HEADER_LEN + 1}, 2147483647)")
    decoded = None
    version = None
    for v in versions:
        cond = fp == F.lit(bytearray(v.fingerprint))
        value = from_avro(body, _schema_json(v), {"mode": "PERMISSIVE", "avroSchema": reader_json})
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
        (F.col("_rec").isNull() | F.col(f"_rec.{required}").isNull(), "corrupt_body"),
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
