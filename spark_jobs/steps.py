"""The shared keep/drop helper: a step answers, per record, a drop reason or null.

A step (filter, dedup, decontamination, ...) builds one Column: ``null`` keeps the record, a
string drops it with that reason (``detail`` may add e.g. which record it duplicates).

The finetune job *tags* rather than splits (:func:`tag`): every record stays in one DataFrame
and carries ``_step``/``_reason``/``_detail`` of the first step that dropped it (null while
live). Why: splitting gave each step a kept and a dropped DataFrame, and counting both per step
cost an action (a Spark job) each and recomputed upstream work for every dropped frame; with
tags the whole pipeline is one lazy plan, per-step counts are one ``groupBy`` at the end, and
the side output is one filter of the same cached frame. A later step only looks at live rows,
so each record still has exactly one reason (the first that held), as before.

:func:`as_dropped` shapes dropped records into one schema for the side output (datatrove's
filter/exclusion-writer split). Dropped text is already PII-redacted: redaction is the first
step after decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import IntegerType, LongType, StringType

#: Columns of the dropped-records side output, in order, with their types.
DROPPED_FIELDS = (
    ("step", StringType()),
    ("reason", StringType()),
    ("detail", StringType()),
    ("record", StringType()),  # ConversationTurn | Feedback
    ("event_id", StringType()),
    ("tenant", StringType()),
    ("subject", StringType()),            # erasure.subject_key(tenant, user_id): no raw user id
    ("conversation_key", StringType()),   # erasure.conversation_key(tenant, user_id, conversation_id)
    ("conversation_id", StringType()),
    ("request_id", StringType()),
    ("trace_id", StringType()),           # the turn's trace (ConversationTurn v3); null for older turns, feedback
    ("turn_index", IntegerType()),
    ("prompt", StringType()),
    ("answer", StringType()),
    ("created_at", LongType()),
    ("oldest_at", LongType()),            # = created_at: what erasure asks of a row
    ("source_topic", StringType()),
    ("source_partition", IntegerType()),
    ("source_offset", LongType()),
    ("source_timestamp", LongType()),  # Kafka record timestamp, epoch ms
)


def as_dropped(df: DataFrame, step: str | None, record: str) -> DataFrame:
    """``df`` (with ``_reason``/``_detail``, and ``_step`` when ``step`` is None) in the dropped-records schema."""
    present = set(df.columns)
    special = {"step": F.lit(step) if step is not None else F.col("_step"), "record": F.lit(record),
               "reason": F.col("_reason"), "detail": F.col("_detail") if "_detail" in present else F.lit(None)}
    if "kafka_ts" in present:
        special["source_timestamp"] = F.col("kafka_ts")
    if "created_at" in present:
        special["oldest_at"] = F.col("created_at")
    return df.select(*[special.get(name, F.col(name) if name in present else F.lit(None)).cast(dtype).alias(name)
                       for name, dtype in DROPPED_FIELDS])


@dataclass
class StepResult:
    kept: DataFrame
    dropped: DataFrame


def is_live() -> Column:
    """True for a row no step has dropped so far (a function: Columns need a running session)."""
    return F.col("_reason").isNull()


def untagged(df: DataFrame) -> DataFrame:
    """``df`` with empty drop tags: every record live."""
    return df.select("*", *[F.lit(None).cast("string").alias(c) for c in ("_step", "_reason", "_detail")])


def tag(df: DataFrame, step: str, reason: Column, detail: Column | None = None) -> DataFrame:
    """Drop the live rows of ``df`` where ``reason`` is not null: set their ``_step``/``_reason``/``_detail``.

    Rows dropped by an earlier step keep their tags (``reason`` is not even looked at there).
    ``reason`` goes into a column first so that it is evaluated once per row, not once per tag.
    """
    hit = F.col("_new").isNotNull()
    new_detail = F.when(hit, detail) if detail is not None else F.lit(None).cast("string")
    tags = {
        "_step": F.when(hit, F.lit(step)).otherwise(F.col("_step")),
        "_detail": F.when(hit, new_detail).otherwise(F.col("_detail")),
        "_reason": F.coalesce(F.col("_reason"), F.col("_new")),
    }
    # Two projections, not one per column: every DataFrame call re-analyses the whole plan, and
    # the plan of the job is long (the driver's planning time grew with each withColumn).
    return df.select("*", F.when(is_live(), reason).alias("_new")).select(
        *[tags[c].alias(c) if c in tags else F.col(c) for c in df.columns])


def live(df: DataFrame) -> DataFrame:
    """The rows of ``df`` no step has dropped, without the tag columns."""
    return df.where(is_live()).drop("_step", "_reason", "_detail")


def materialize(df: DataFrame) -> DataFrame:
    """``df`` computed now and kept on the executors, as a DataFrame whose plan is one node.

    ``localCheckpoint`` rather than ``persist``: a cached frame keeps its whole logical plan,
    and every later DataFrame call re-analysed that plan (the job's plan grew to megabytes of
    text; analysis cost more CPU than the rows at 5k turns, see docs/spark_jobs.md). The price:
    the blocks are not replicated, so losing an executor fails the job instead of recomputing
    (a batch job to rerun; on one machine nothing changes). :func:`release_materialized` frees them.
    """
    return df.localCheckpoint(eager=True)


def persistent_rdd_ids(spark) -> set[int]:
    return {int(i) for i in spark.sparkContext._jsc.getPersistentRDDs().keySet()}


def release_materialized(spark, before: set[int]) -> None:
    """Unpersist the RDDs stored since ``before`` (``persistent_rdd_ids``): checkpoints included,
    which ``spark.catalog.clearCache()`` does not touch."""
    rdds = spark.sparkContext._jsc.getPersistentRDDs()
    for rdd_id in persistent_rdd_ids(spark) - before:
        rdds.get(rdd_id).unpersist(False)


def first_reason(*checks: tuple[Column, str]) -> Column:
    """The reason of the first check that holds, else null (one reason per dropped record)."""
    expr = None
    for cond, reason in checks:
        expr = F.when(cond, F.lit(reason)) if expr is None else expr.when(cond, F.lit(reason))
    return expr if expr is not None else F.lit(None).cast("string")
