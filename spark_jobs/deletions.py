"""Deletions (``chat.deletions``) applied by the finetune job: an erased user's or conversation's
turns and feedback never reach a dataset built afterwards (issue 19, contract C4).

Where they come from: every Deletion archived under ``<archive>/chat.deletions/`` (the archive
agent writes that folder in the layout of ``transport/archive.py``) whenever the job has an
archive folder, and the whole ``chat.deletions`` topic when the job reads Kafka (kept forever,
never compacted: the source of truth). Not limited to the job's time range: a run over last
week's turns applies a deletion made a year ago as well as one made this morning. Copies of one
Deletion (the same event id from both sources) count once.

The rule: a record (turn or feedback) of (tenant, user_id) is excluded when a USER Deletion of
that subject, or a CONVERSATION Deletion of its (tenant, user_id, conversation_id), has a
``created_at`` at or after the record's own ``created_at``. Records created later are kept (the
user came back). A CONVERSATION Deletion without a conversation id erases the whole user (it
cannot be narrowed, and erasing too much is the safe side). Excluded records go to no output,
not even ``parquet/dropped``; the card counts them (``erasure``).

An undecodable record on the deletions topic cannot say whom it erases: it is counted
(``deletions_undecodable`` in the card) and the job prints a warning, but it does not stop every
future build.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from spark_jobs.decode import decode_records
from spark_jobs.erasure import AppliedErasure, conversation_key_column, subject_column
from spark_jobs.sources import RAW_SCHEMA, read_archive, read_kafka


@dataclass
class Erasures:
    """The cutoffs to apply: per subject (USER) and per conversation key (CONVERSATION)."""

    applied: list[AppliedErasure]
    read: int          # distinct Deletions read
    undecodable: int   # records of the deletions topic that could not be decoded


def raw_deletions(spark: SparkSession, s, kafka) -> DataFrame:
    """Every archived Deletion (when the job has an archive folder) and, for a Kafka source, every
    record of the topic (when it exists: a deployment that never erased anyone may not have it)."""
    from transport.admin import TopicAdmin

    topic = kafka.topic(s.deletions_topic)
    raw = spark.createDataFrame([], RAW_SCHEMA)
    if s.archive_dir is not None and Path(s.archive_dir).is_dir():
        raw = raw.unionByName(read_archive(spark, s.archive_dir, topic))
    if s.source == "kafka" and topic in TopicAdmin(kafka).topic_partitions():
        raw = raw.unionByName(read_kafka(spark, kafka.spark_kafka_options(), topic))
    return raw


def load_erasures(spark: SparkSession, s, kafka) -> Erasures:
    """The Deletions, reduced to the latest ``created_at`` per subject / conversation (one small
    Spark job; the result is collected: it is the manifest's ``erasures_applied`` too)."""
    decoded = decode_records(raw_deletions(spark, s, kafka), "Deletion")
    d = decoded.kept.dropDuplicates(["event_id"])
    whole_user = (F.col("scope") == "USER") | F.col("conversation_id").isNull()
    cut = d.select(subject_column().alias("subject"),
                   F.when(whole_user, F.lit(None).cast("string")).otherwise(conversation_key_column()).alias("ck"),
                   "created_at", F.lit(1).alias("_one"))
    rows = cut.groupBy("subject", "ck").agg(F.max("created_at").alias("up_to"), F.sum("_one").alias("n")).collect()
    undecodable = decoded.dropped.count()
    return Erasures([AppliedErasure(r["subject"], r["ck"], int(r["up_to"])) for r in rows],
                    sum(int(r["n"]) for r in rows), undecodable)


def mark_erased(spark: SparkSession, df: DataFrame, erasures: Erasures) -> DataFrame:
    """``df`` (with ``subject``, ``conversation_key``, ``created_at``) plus ``_erased``: true for a
    record some Deletion covers (module doc). Two broadcast look-ups, one per scope."""
    users = [(a.subject, a.up_to_ms) for a in erasures.applied if a.conversation_key is None]
    convs = [(a.conversation_key, a.up_to_ms) for a in erasures.applied if a.conversation_key is not None]
    if not users and not convs:
        return df.withColumn("_erased", F.lit(False))
    u = spark.createDataFrame(users, "subject string, _user_cut long")
    c = spark.createDataFrame(convs, "conversation_key string, _conv_cut long")
    out = df.join(F.broadcast(u), "subject", "left").join(F.broadcast(c), "conversation_key", "left")
    cut = F.greatest(F.col("_user_cut"), F.col("_conv_cut"))  # greatest skips nulls
    erased = F.coalesce(F.col("created_at") <= cut, F.lit(False))
    return out.select(*df.columns, erased.alias("_erased"))
