"""The shared keep/drop helper: a step answers, per record, a drop reason or null.

A step (filter, dedup, decontamination, ...) builds one Column: ``null`` keeps the record, a
string drops it with that reason (``detail`` may add e.g. which record it duplicates). This
module splits the DataFrame on it and shapes every dropped record into one schema, so the
job can count drops per step and reason and write them all to one side output (datatrove's
filter/exclusion-writer split). Dropped text is already PII-redacted: redaction is the first
step after decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    ("conversation_id", StringType()),
    ("request_id", StringType()),
    ("turn_index", IntegerType()),
    ("prompt", StringType()),
    ("answer", StringType()),
    ("created_at", LongType()),
    ("source_topic", StringType()),
    ("source_partition", IntegerType()),
    ("source_offset", LongType()),
    ("source_timestamp", LongType()),  # Kafka record timestamp, epoch ms
)


def as_dropped(df: DataFrame, step: str, record: str) -> DataFrame:
    """``df`` (with ``_reason``/``_detail``) in the dropped-records schema."""
    cols = []
    present = set(df.columns)
    for name, dtype in DROPPED_FIELDS:
        if name == "step":
            col = F.lit(step)
        elif name == "record":
            col = F.lit(record)
        elif name == "reason":
            col = F.col("_reason")
        elif name == "detail":
            col = F.col("_detail") if "_detail" in present else F.lit(None)
        elif name == "source_timestamp" and "kafka_ts" in present:
            col = F.col("kafka_ts")
        elif name in present:
            col = F.col(name)
        else:
            col = F.lit(None)
        cols.append(col.cast(dtype).alias(name))
    return df.select(*cols)


@dataclass
class StepResult:
    kept: DataFrame
    dropped: DataFrame


def split_by_reason(df: DataFrame, step: str, reason: Column, detail: Column | None = None,
                    record: str = "ConversationTurn") -> StepResult:
    """Keep rows where ``reason`` is null; the rest become dropped records of ``step``."""
    tagged = df.withColumn("_reason", reason)
    if detail is not None:
        tagged = tagged.withColumn("_detail", detail)
    kept = tagged.where(F.col("_reason").isNull()).drop("_reason", "_detail")
    dropped = as_dropped(tagged.where(F.col("_reason").isNotNull()), step, record)
    return StepResult(kept, dropped)


def first_reason(*checks: tuple[Column, str]) -> Column:
    """The reason of the first check that holds, else null (one reason per dropped record)."""
    expr = None
    for cond, reason in checks:
        expr = F.when(cond, F.lit(reason)) if expr is None else expr.when(cond, F.lit(reason))
    return expr if expr is not None else F.lit(None).cast("string")


@dataclass
class DropLog:
    """Every step's dropped records, for the side output and the per-reason counts."""

    frames: list[DataFrame] = field(default_factory=list)

    def add(self, dropped: DataFrame) -> None:
        self.frames.append(dropped)

    def union(self) -> DataFrame | None:
        if not self.frames:
            return None
        out = self.frames[0]
        for f in self.frames[1:]:
            out = out.unionByName(f)
        return out
