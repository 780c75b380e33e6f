"""Spark finetune job vs the same steps in one Python process, on the same generated log.

Prints records/s of each (turns in / wall time of the job, excluding Spark session start and
the log generation), the ratio, and the near-dup step's time over the exact-dedup step's for
both. ``--quick``: small log for CI (about a minute on 2 cores); default: 200k turns.
The last line is the headline ratio.

The Spark job runs its steps as one lazy plan (no action per step), so its own timings are per
phase; the near-dup/exact-dedup ratio is measured after the run by timing each dedup step
alone, as one action over the same cached SFT candidates.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import finetune_reference as reference  # noqa: E402  (bench/, beside this script)
from spark_jobs.settings import FinetuneSettings, SparkSettings  # noqa: E402
from tests.spark.synthetic_log import generate, to_messages  # noqa: E402
from transport.archive import write_messages  # noqa: E402


def spark_dedup_seconds(spark, s, kafka) -> tuple[float, float]:
    """(exact_dedup, near_dedup) seconds, each step alone over the same cached SFT candidates."""
    from pyspark.sql import functions as F

    from spark_jobs.dedup import exact_dedup, near_dedup
    from spark_jobs.finetune_dataset import decoded_inputs, sft_candidates

    turns, feedback = decoded_inputs(spark, s, kafka)
    cands = sft_candidates(spark, s, turns, feedback).persist()
    cands.count()
    t = time.perf_counter()
    exact = exact_dedup(cands).persist()
    exact.where(F.col("_step") == "exact_dedup").count()
    exact_s = time.perf_counter() - t
    t = time.perf_counter()
    near_dedup(exact, s.near_dup_threshold, s.near_dup_ngram, s.near_dup_hash_tables, s.seed).where(
        F.col("_step") == "near_dedup").count()
    near_s = time.perf_counter() - t
    spark.catalog.clearCache()
    return exact_s, near_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--master", default="local[*]")
    args = ap.parse_args()
    n = args.turns or (5_000 if args.quick else 200_000)
    work = Path(tempfile.mkdtemp(prefix="bench-finetune-"))
    try:
        log = generate(n_turns=n, seed=3)
        msgs = to_messages(log, "chat.turns", "chat.feedback", partitions=6)
        write_messages(work / "archive", msgs)
        (work / "eval.txt").write_text("\n".join(log.eval_lines))
        s = FinetuneSettings(source="archive", archive_dir=work / "archive", out=work / "spark",
                             eval_files=(work / "eval.txt",))
        n_in = len(log.turns)
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; turns: {n_in}")

        from spark_jobs.finetune_dataset import run
        from spark_jobs.session import build_session
        from transport.settings import KafkaSettings

        spark = build_session(SparkSettings(master=args.master, shuffle_partitions=max(4, (os.cpu_count() or 2) * 2),
                                            progress=False))
        t = time.perf_counter()
        res = run(spark, s, KafkaSettings())
        spark_s = time.perf_counter() - t
        t = time.perf_counter()
        ref, ref_secs = reference.run(msgs, s, work / "python")
        py_s = time.perf_counter() - t
        print(f"spark:       {spark_s:8.2f} s  {n_in / spark_s:10.0f} records/s  steps: "
              + ", ".join(f"{k}={v:.2f}s" for k, v in res.seconds.items()))
        print(f"pure-python: {py_s:8.2f} s  {n_in / py_s:10.0f} records/s  steps: "
              + ", ".join(f"{k}={v:.2f}s" for k, v in ref_secs.items()))
        sft_spark = sum(v for k, v in res.card["outputs"].items() if k.startswith("sft/"))
        print(f"sft examples: spark {sft_spark}, pure-python {ref['sft']}")
        exact_s, near_s = spark_dedup_seconds(spark, s, KafkaSettings())
        print(f"spark dedup steps alone: exact_dedup={exact_s:.2f}s, near_dedup={near_s:.2f}s")
        print(f"near-dup vs exact-dedup time ratio: spark = "
              f"{near_s / exact_s:.1f}, pure-python = "
              f"{ref_secs['near_dedup'] / max(ref_secs['exact_dedup'], 1e-9):.1f}")
        print(f"spark/finetune records/s ratio vs pure-python = {py_s / spark_s:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
