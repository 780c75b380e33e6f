"""``chatpipe job finetune-dataset``: logged turns + feedback -> fine-tuning datasets.

Steps (each counts what it drops, and why; dropped records go to ``parquet/dropped``):

    read (Kafka or archive) -> decode -> erasure (chat.deletions: left out, counted)
      -> redact PII -> feedback_owner (feedback from another tenant/user)
      -> quality -> decontam -> join feedback on (tenant, request_id)
      -> SFT candidates (feedback: rated_down) -> exact_dedup -> near_dedup -> history + split
      -> preference pairs (same prompt rated up and down; edits)
    -> sft/{train,validation}.jsonl, preference/{train,validation}.jsonl,
       parquet/{sft,preference,dropped}/, dataset_card.{md,json}, _chatpipe_dataset.json

Conversations are keyed by (tenant, user_id, conversation_id) everywhere (history, pairs,
split: ``conversation_key``); Parquet rows carry ``subject`` (a hash of tenant and user, no raw
user id), ``conversation_key``, ``request_id`` and ``oldest_at`` so an erasure can find them
(``spark_jobs.erasure``); the manifest says when the dataset was built and which erasures it
applied. Lineage: SFT and dropped rows carry their turn's ``request_id`` and ``trace_id``, SFT and
preference rows ``request_ids`` / ``trace_ids`` of every turn they hold, in turn order
(docs/observability.md "Lineage").

Also runnable as ``spark-submit spark_jobs/finetune_dataset.py --out DIR [--source ...]``.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from spark_jobs import card as card_mod
from spark_jobs.chat_format import (est_tokens, history_pool, lineage_ids, prompt_messages, sft_messages,
                                   with_history)
from spark_jobs.decode import decode_tagged
from spark_jobs.decontam import decontaminate
from spark_jobs.dedup import exact_dedup, near_dedup, normalized_text
from spark_jobs.deletions import Erasures, load_erasures, mark_erased
from spark_jobs.erasure import conversation_key_column, subject_column, write_manifest
from spark_jobs.feedback import (check_owner, drop_rated_down, join_ratings, latest_ratings, preference_pairs,
                                 redact_feedback)
from spark_jobs.filters import tag_quality
from spark_jobs.pii import redact_column
from spark_jobs.preflight import check_inputs, input_bytes, job_output
from spark_jobs.progress import StepTimer
from spark_jobs.settings import FinetuneSettings
from spark_jobs.sources import read_archive, read_kafka
from spark_jobs.split import split_column
from spark_jobs.steps import as_dropped, is_live, live, materialize, persistent_rdd_ids, release_materialized
from spark_jobs.tally import fill_card, tally
from spark_jobs.writers import write_json, write_jsonl, write_parquet


@dataclass
class FinetuneResult:
    out: Path
    card: dict
    seconds: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def read_topic(spark: SparkSession, s, kafka, catalog_name: str) -> DataFrame:
    topic = kafka.topic(catalog_name)
    if s.source == "kafka":
        return read_kafka(spark, kafka.spark_kafka_options(), topic, s.since, s.until)
    return read_archive(spark, s.archive_dir, topic, s.since, s.until)


def _histograms(df: DataFrame, cols: dict[str, str]) -> dict[str, dict[str, int]]:
    """Length histograms of several columns in one aggregate (one Spark job, not one per column)."""
    edges = card_mod.HIST_EDGES
    aggs = []
    for j, col in enumerate(cols.values()):
        # the highest edge the value reaches (greatest skips the nulls of the edges it does not reach)
        bucket = F.greatest(*[F.when(F.col(col) >= edge, F.lit(i)) for i, edge in enumerate(edges)])
        aggs += [F.count(F.when(bucket == i, 1)).alias(f"h{j}_{i}") for i in range(len(edges))]
    row = df.agg(*aggs).first()
    return {name: {card_mod.bucket_label(i): int(row[f"h{j}_{i}"]) for i in range(len(edges))}
            for j, name in enumerate(cols)}


def with_keys(df: DataFrame) -> DataFrame:
    """``df`` plus ``subject`` and ``conversation_key`` (``spark_jobs.erasure``)."""
    return df.select("*", subject_column().alias("subject"), conversation_key_column().alias("conversation_key"))


def erased_inputs(spark: SparkSession, s: FinetuneSettings, kafka,
                  erasures: Erasures) -> tuple[DataFrame, DataFrame, dict[str, int]]:
    """(turns, feedback, records excluded for erasure per record type): decoded, keyed, erased
    records left out, redacted, tagged with decode drops and (feedback) ``feedback_owner`` drops;
    materialised (both are read more than once, and later plans start from them, see
    ``steps.materialize``)."""
    t = mark_erased(spark, with_keys(decode_tagged(read_topic(spark, s, kafka, s.turns_topic), "ConversationTurn")),
                    erasures)
    for name in ("system_prompt", "prompt", "answer"):
        t = t.withColumn(name, redact_column(F.col(name)))
    t = materialize(t.withColumn("_norm", normalized_text()))  # the dedup/decontam key, once (``dedup.norm_column``)
    f = materialize(mark_erased(spark, redact_feedback(with_keys(
        decode_tagged(read_topic(spark, s, kafka, s.feedback_topic), "Feedback"))), erasures))
    counts = (t.select(F.lit("ConversationTurn").alias("record"), "_erased")
              .unionByName(f.select(F.lit("Feedback").alias("record"), "_erased"))
              .where("_erased").groupBy("record").count().collect())
    erased = {"ConversationTurn": 0, "Feedback": 0} | {r["record"]: int(r["count"]) for r in counts}
    t = t.where(~F.col("_erased")).drop("_erased")
    f = f.where(~F.col("_erased")).drop("_erased")
    return t, materialize(check_owner(f, live(t))), erased


def sft_candidates(spark: SparkSession, s: FinetuneSettings, turns: DataFrame, feedback: DataFrame) -> DataFrame:
    """Tagged turns through quality, decontamination and feedback (lazy)."""
    t = tag_quality(turns, s, spark)
    t = decontaminate(t, spark, s.eval_files, s.decontam_ngram, hashed=turns)
    return drop_rated_down(join_ratings(t, latest_ratings(live(feedback))))


def tagged_turns(spark: SparkSession, s: FinetuneSettings, turns: DataFrame, feedback: DataFrame) -> DataFrame:
    """Decoded, redacted turns through every filter step, each record tagged with what dropped it.

    Lazy after the frame before near-dedup, which is materialised (MinHash reads its live rows
    several times, the result is joined back; ``steps.materialize``).
    """
    t = materialize(exact_dedup(sft_candidates(spark, s, turns, feedback)))
    return near_dedup(t, s.near_dup_threshold, s.near_dup_ngram, s.near_dup_hash_tables, s.seed).drop("_norm")


def build(spark: SparkSession, s: FinetuneSettings, kafka, timer: StepTimer, tmp: Path) -> dict:
    """Run every step and write the outputs into ``tmp``; returns the card as a dict.

    Few Spark jobs on purpose (fixed cost per job dominated small runs): one aggregate for the
    card's counts, one histogram aggregate, and one write per output table.
    """
    card = card_mod.Card(settings=s.model_dump(mode="json", exclude={"out", "overwrite", "archive_dir"}))
    built_at_ms = int(time.time() * 1000)  # before the deletions are read: what they cannot have covered is later

    with timer.step("decode+filters+dedup"):
        erasures = load_erasures(spark, s, kafka)
        decoded, feedback, erased = erased_inputs(spark, s, kafka, erasures)
        turns = materialize(tagged_turns(spark, s, decoded, feedback))
        fill_card(card, tally(turns, feedback), s.source, s.since, s.until, erased)
        card.erasure = {"deletions_read": erasures.read, "deletions_undecodable": erasures.undecodable,
                        "turns_excluded": erased["ConversationTurn"], "feedback_excluded": erased["Feedback"]}

    with timer.step("format"):
        rated = turns.where(is_live() | F.col("_step").isin("feedback", "exact_dedup", "near_dedup"))
        pool = history_pool(rated)
        sft = live(turns)
        own = est_tokens(F.col("system_prompt")) + est_tokens(F.col("prompt")) + est_tokens(F.col("answer"))
        # Every message's estimate summed: system (or the default), the history (``history_tokens``,
        # summed when it was fitted), prompt, answer. Not a lambda over ``messages``: Spark runs
        # lambdas interpreted, and that one measured every text again.
        example_tokens = (est_tokens(F.coalesce(F.col("system_prompt"), F.lit(s.default_system_prompt)))
                          + est_tokens(F.col("prompt")) + est_tokens(F.col("answer")) + F.col("history_tokens")).cast("int")
        sft_rows = materialize(with_history(sft, pool, "event_id", own, s.max_context_tokens).select(
            "event_id", "tenant", "subject", "conversation_key", "conversation_id", "turn_index", "request_id",
            "trace_id", lineage_ids("h_request_id", F.array("request_id")).alias("request_ids"),
            lineage_ids("h_trace_id", F.array("trace_id")).alias("trace_ids"), "model", "created_at", F.least("created_at", "history_oldest_at").alias("oldest_at"),
            F.size("history").alias("history_turns"), sft_messages(s.default_system_prompt).alias("messages"),
            est_tokens(F.col("prompt")).alias("prompt_tokens"), est_tokens(F.col("answer")).alias("answer_tokens"),
            split_column(s.validation_fraction).alias("split"), example_tokens.alias("example_tokens")))
        pairs = preference_pairs(rated).withColumn("pair_id", F.concat_ws("|", "chosen_event_id", "rejected_event_id"))
        own_pair = est_tokens(F.col("system_prompt")) + est_tokens(F.col("prompt")) + F.greatest(
            est_tokens(F.col("chosen")), est_tokens(F.col("rejected")))
        # An edit's two sides are one turn: its ids once. Otherwise the chosen turn's, then the rejected one's.
        def sides(name: str):
            return F.when(F.col("pair_source") == "edit", F.array(f"chosen_{name}")).otherwise(
                F.array(f"chosen_{name}", f"rejected_{name}"))
        pair_rows = materialize(with_history(pairs, pool, "pair_id", own_pair, s.max_context_tokens).select(
            "pair_id", "tenant", "subject", "conversation_key", "conversation_id", "turn_index", "chosen_event_id",
            "rejected_event_id", "chosen_request_id", "rejected_request_id", "chosen_trace_id", "rejected_trace_id",
            lineage_ids("h_request_id", sides("request_id")).alias("request_ids"),
            lineage_ids("h_trace_id", sides("trace_id")).alias("trace_ids"), "pair_source", "created_at",
            F.least("created_at", "rejected_created_at", "history_oldest_at").alias("oldest_at"),
            prompt_messages(s.default_system_prompt).alias("prompt_messages"),
            F.array(F.struct(F.lit("assistant").alias("role"), F.col("chosen").alias("content"))).alias("chosen"),
            F.array(F.struct(F.lit("assistant").alias("role"), F.col("rejected").alias("content"))).alias("rejected"),
            split_column(s.validation_fraction).alias("split")))

    with timer.step("write"):
        # conversation_key after the readable id: two tenants' (or users') "chat-1" never interleave
        order = ["tenant", "conversation_id", "conversation_key", "turn_index", "created_at", "event_id"]
        pair_order = ["tenant", "conversation_id", "conversation_key", "turn_index", "pair_id"]
        splits = ("train", "validation")
        ppairs = pair_rows.select(
            "*", F.struct(F.col("prompt_messages").alias("messages")).alias("input"),
            F.col("chosen").alias("preferred_output"), F.col("rejected").alias("non_preferred_output"))
        dropped = as_dropped(turns.where(~is_live()), None, "ConversationTurn").unionByName(
            as_dropped(feedback.where(~is_live()), None, "Feedback"))
        # Each table is written by one task (one sorted partition, ``writers``): the tables go side
        # by side, each Spark job from a thread of its own, so every core has a table to write (one
        # thread per core Spark has, at least 2).
        with ThreadPoolExecutor(max_workers=max(2, spark.sparkContext.defaultParallelism)) as pool:
            sft_n = pool.submit(write_jsonl, sft_rows, order, ["messages"],
                                {sp: tmp / "sft" / f"{sp}.jsonl" for sp in splits})
            pref_n = pool.submit(write_jsonl, ppairs, pair_order, ["input", "preferred_output", "non_preferred_output"],
                                 {sp: tmp / "preference" / f"{sp}.jsonl" for sp in splits})
            parquet = [pool.submit(write_parquet, sft_rows, order, tmp / "parquet" / "sft", partition_by="split"),
                       pool.submit(write_parquet, pair_rows, pair_order, tmp / "parquet" / "preference",
                                   partition_by="split")]
            if s.write_dropped:
                parquet.append(pool.submit(
                    write_parquet, dropped, ["step", "reason", "source_topic", "source_partition", "source_offset",
                                             "event_id"], tmp / "parquet" / "dropped"))
            histograms = pool.submit(_histograms, sft_rows, {
                "sft prompt": "prompt_tokens", "sft answer": "answer_tokens",
                "sft example incl. history": "example_tokens"})
            for sp in splits:  # the card's order, as before: per split, SFT then preference
                card.outputs[f"sft/{sp}.jsonl"] = sft_n.result()[sp]
                card.outputs[f"preference/{sp}.jsonl"] = pref_n.result()[sp]
            for done in parquet:
                done.result()  # re-raises a failed write
            card.histograms = histograms.result()
        doc = card.to_json()
        write_json(doc, tmp / "dataset_card.json")
        (tmp / "dataset_card.md").write_text(card.to_markdown(), encoding="utf-8")
        # Not in the card: a rerun writes the same card, the build time differs.
        write_manifest(tmp, built_at_ms, erasures.applied)
    return doc


def erasure_warnings(card: dict) -> list[str]:
    n = card.get("erasure", {}).get("deletions_undecodable", 0)
    if not n:
        return []
    return [f"warning: {n} record(s) of the deletions topic could not be decoded: the users they erase cannot "
            "be known, and their rows may be in this dataset"]


def run(spark: SparkSession, s: FinetuneSettings, kafka, timer: StepTimer | None = None) -> FinetuneResult:
    timer = timer or StepTimer(enabled=False)
    check_inputs(s, kafka)  # one-line errors before any Spark work (spark_jobs.preflight)
    with job_output(s.out, s.overwrite, "finetune-dataset") as tmp:
        stored_before = persistent_rdd_ids(spark)
        try:
            doc = build(spark, s, kafka, timer, tmp)
        finally:
            spark.catalog.clearCache()
            release_materialized(spark, stored_before)
    return FinetuneResult(Path(s.out).resolve(), doc, dict(timer.seconds), erasure_warnings(doc))


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``spark-submit spark_jobs/finetune_dataset.py --out DIR ...``."""
    from spark_jobs.cli_args import parse_job_args
    from spark_jobs.session import build_session

    spark_s, job_s, kafka = parse_job_args(FinetuneSettings, argv)
    spark = build_session(spark_s, input_bytes(job_s, kafka))
    result = run(spark, job_s, kafka, StepTimer(enabled=spark_s.progress))
    for line in result.warnings:
        print(line, file=sys.stderr)
    print(f"wrote {result.out}: " + ", ".join(f"{k}={v}" for k, v in result.card["outputs"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
