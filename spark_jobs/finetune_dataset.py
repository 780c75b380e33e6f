"""``chatpipe job finetune-dataset``: logged turns + feedback -> fine-tuning datasets.

Steps (each counts what it drops, and why; dropped records go to ``parquet/dropped``):

    read (Kafka or archive) -> decode -> redact PII -> quality -> decontam -> join feedback
      -> SFT candidates (feedback: rated_down) -> exact_dedup -> near_dedup -> history + split
      -> preference pairs (same prompt rated up and down; edits)
    -> sft/{train,validation}.jsonl, preference/{train,validation}.jsonl,
       parquet/{sft,preference,dropped}/, dataset_card.{md,json}

Also runnable as ``spark-submit spark_jobs/finetune_dataset.py --out DIR [--source ...]``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from spark_jobs import card as card_mod
from spark_jobs.chat_format import est_tokens, history_pool, prompt_messages, sft_messages, with_history
from spark_jobs.decode import decode_records
from spark_jobs.decontam import decontaminate
from spark_jobs.dedup import exact_dedup, near_dedup
from spark_jobs.feedback import join_ratings, latest_ratings, preference_pairs, redact_feedback, sft_candidates
from spark_jobs.filters import quality_reason
from spark_jobs.pii import KINDS, placeholder_count, redact_column
from spark_jobs.progress import StepTimer
from spark_jobs.settings import FinetuneSettings
from spark_jobs.sources import read_archive, read_kafka
from spark_jobs.split import split_column
from spark_jobs.steps import DropLog, split_by_reason
from spark_jobs.writers import atomic_output, check_output, write_json, write_jsonl, write_parquet


@dataclass
class FinetuneResult:
    out: Path
    card: dict
    seconds: dict[str, float] = field(default_factory=dict)


def read_topic(spark: SparkSession, s, kafka, catalog_name: str) -> DataFrame:
    topic = kafka.topic(catalog_name)
    if s.source == "kafka":
        return read_kafka(spark, kafka.bootstrap_servers, topic, s.since, s.until)
    return read_archive(spark, s.archive_dir, topic, s.since, s.until)


def _persist(df: DataFrame) -> tuple[DataFrame, int]:
    df = df.persist()
    return df, df.count()


def _histogram(df: DataFrame, col) -> dict[str, int]:
    edges = card_mod.HIST_EDGES
    bucket = None
    for i in range(len(edges) - 1, -1, -1):  # highest edge first: the first that holds wins
        bucket = F.when(col >= edges[i], F.lit(i)) if bucket is None else bucket.when(col >= edges[i], F.lit(i))
    counts = {r.b: r["count"] for r in df.groupBy(bucket.alias("b")).count().collect()}
    return {card_mod.bucket_label(i): counts.get(i, 0) for i in range(len(edges))}


def build(spark: SparkSession, s: FinetuneSettings, kafka, timer: StepTimer, tmp: Path) -> dict:
    """Run every step and write the outputs into ``tmp``; returns the card as a dict."""
    card = card_mod.Card(settings=s.model_dump(mode="json", exclude={"out", "overwrite", "archive_dir"}))
    drops = DropLog()
    steps = card.steps

    with timer.step("read+decode"):
        t = decode_records(read_topic(spark, s, kafka, s.turns_topic), "ConversationTurn")
        f = decode_records(read_topic(spark, s, kafka, s.feedback_topic), "Feedback")
        drops.add(t.dropped)
        drops.add(f.dropped)
        redacted = t.kept
        for name in ("system_prompt", "prompt", "answer"):
            redacted = redacted.withColumn(name, redact_column(F.col(name)))
        turns, n_turns = _persist(redacted)
        feedback, n_feedback = _persist(redact_feedback(f.kept))
        n_dec_drop_t, n_dec_drop_f = t.dropped.count(), f.dropped.count()
    steps.append({"step": "decode turns", "input": n_turns + n_dec_drop_t, "kept": n_turns, "dropped": n_dec_drop_t})
    steps.append({"step": "decode feedback", "input": n_feedback + n_dec_drop_f, "kept": n_feedback,
                  "dropped": n_dec_drop_f})
    versions = {f"ConversationTurn v{r.writer_version}": r["count"]
                for r in turns.groupBy("writer_version").count().orderBy("writer_version").collect()}
    card.input = {"source": s.source, "since_ms": s.since, "until_ms": s.until,
                  "turns_read": n_turns + n_dec_drop_t, "feedback_read": n_feedback + n_dec_drop_f, **versions}

    with timer.step("redact"):
        sums = turns.select(*[
            F.sum(sum((placeholder_count(F.col(c), k) for c in ("system_prompt", "prompt", "answer")), F.lit(0)))
            .alias(k) for k in KINDS]).first()
        card.pii = {k: int(sums[k] or 0) for k in KINDS}

    def run_step(name: str, result, n_in: int) -> tuple[DataFrame, int]:
        with timer.step(name):
            kept, n = _persist(result.kept)
        drops.add(result.dropped)
        steps.append({"step": name, "input": n_in, "kept": n, "dropped": n_in - n})
        return kept, n

    good, n = run_step("quality", split_by_reason(turns, "quality", quality_reason(s)), n_turns)
    good, n = run_step("decontam", decontaminate(good, spark, s.eval_files, s.decontam_ngram), n)
    rated = join_ratings(good, latest_ratings(feedback))
    sft, n = run_step("feedback", sft_candidates(rated), n)
    sft, n = run_step("exact_dedup", exact_dedup(sft), n)
    sft, n = run_step("near_dedup", near_dedup(sft, s.near_dup_threshold, s.near_dup_ngram,
                                                s.near_dup_hash_tables, s.seed), n)

    with timer.step("format"):
        pool = history_pool(rated)
        own = est_tokens(F.col("system_prompt")) + est_tokens(F.col("prompt")) + est_tokens(F.col("answer"))
        sft_rows = with_history(sft, pool, "event_id", own, s.max_context_tokens).select(
            "event_id", "conversation_id", "turn_index", "request_id", "model", "created_at",
            F.size("history").alias("history_turns"), sft_messages(s.default_system_prompt).alias("messages"),
            est_tokens(F.col("prompt")).alias("prompt_tokens"), est_tokens(F.col("answer")).alias("answer_tokens"),
            split_column(s.validation_fraction).alias("split"))
        sft_rows = sft_rows.withColumn("example_tokens", F.aggregate(
            "messages", F.lit(0).cast("long"), lambda acc, m: acc + F.ceil(F.length(m["content"]) / 4) + 4).cast("int"))
        sft_rows, _ = _persist(sft_rows)
        pairs = preference_pairs(rated).withColumn("pair_id", F.concat_ws("|", "chosen_event_id", "rejected_event_id"))
        own_pair = est_tokens(F.col("system_prompt")) + est_tokens(F.col("prompt")) + F.greatest(
            est_tokens(F.col("chosen")), est_tokens(F.col("rejected")))
        pair_rows = with_history(pairs, pool, "pair_id", own_pair, s.max_context_tokens).select(
            "pair_id", "conversation_id", "turn_index", "chosen_event_id", "rejected_event_id", "pair_source",
            "created_at", prompt_messages(s.default_system_prompt).alias("prompt_messages"),
            F.array(F.struct(F.lit("assistant").alias("role"), F.col("chosen").alias("content"))).alias("chosen"),
            F.array(F.struct(F.lit("assistant").alias("role"), F.col("rejected").alias("content"))).alias("rejected"),
            split_column(s.validation_fraction).alias("split"))
        pair_rows, _ = _persist(pair_rows)

    with timer.step("write"):
        order = ["conversation_id", "turn_index", "created_at", "event_id"]
        for split in ("train", "validation"):
            part = sft_rows.where(F.col("split") == split)
            card.outputs[f"sft/{split}.jsonl"] = write_jsonl(part, order, ["messages"], tmp / "sft" / f"{split}.jsonl")
            ppart = pair_rows.where(F.col("split") == split).select(
                "*", F.struct(F.col("prompt_messages").alias("messages")).alias("input"),
                F.col("chosen").alias("preferred_output"), F.col("rejected").alias("non_preferred_output"))
            card.outputs[f"preference/{split}.jsonl"] = write_jsonl(
                ppart, ["conversation_id", "turn_index", "pair_id"],
                ["input", "preferred_output", "non_preferred_output"], tmp / "preference" / f"{split}.jsonl")
        write_parquet(sft_rows, order, tmp / "parquet" / "sft", partition_by="split")
        write_parquet(pair_rows, ["conversation_id", "turn_index", "pair_id"], tmp / "parquet" / "preference",
                      partition_by="split")
        dropped = drops.union()
        drop_counts = dropped.groupBy("step", "reason").count().collect()
        for r in sorted(drop_counts, key=lambda r: (r.step, r.reason)):
            card.drops.setdefault(r.step, {})[r.reason] = r["count"]
        if s.write_dropped:
            write_parquet(dropped, ["step", "reason", "source_topic", "source_partition", "source_offset", "event_id"],
                          tmp / "parquet" / "dropped")
        card.histograms = {
            "sft prompt": _histogram(sft_rows, F.col("prompt_tokens")),
            "sft answer": _histogram(sft_rows, F.col("answer_tokens")),
            "sft example incl. history": _histogram(sft_rows, F.col("example_tokens")),
        }
        doc = card.to_json()
        write_json(doc, tmp / "dataset_card.json")
        (tmp / "dataset_card.md").write_text(card.to_markdown(), encoding="utf-8")
    return doc


def run(spark: SparkSession, s: FinetuneSettings, kafka, timer: StepTimer | None = None) -> FinetuneResult:
    timer = timer or StepTimer(enabled=False)
    check_output(s.out, s.overwrite)
    with atomic_output(s.out, s.overwrite) as tmp:
        try:
            doc = build(spark, s, kafka, timer, tmp)
        finally:
            spark.catalog.clearCache()
    return FinetuneResult(Path(s.out).resolve(), doc, dict(timer.seconds))


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``spark-submit spark_jobs/finetune_dataset.py --out DIR ...``."""
    from spark_jobs.cli_args import parse_job_args
    from spark_jobs.session import build_session

    spark_s, job_s, kafka = parse_job_args(FinetuneSettings, argv)
    spark = build_session(spark_s)
    result = run(spark, job_s, kafka, StepTimer(enabled=spark_s.progress))
    print(f"wrote {result.out}: " + ", ".join(f"{k}={v}" for k, v in result.card["outputs"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
