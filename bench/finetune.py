"""Spark finetune job vs the same steps in one Python process, on the same generated log.

Prints records/s of each (turns in / wall time of the job, excluding Spark session start and
the log generation), the ratio, and the near-dup step's time over the exact-dedup step's for
both. ``--quick``: small log for CI (about a minute on 2 cores); default: 200k turns.
The last line is the headline ratio.

Also printed: the session start and the Spark side's wall time including it (the ``--quick``
target), the JVM's and Python's CPU seconds (less dependent on the shared machine's load than
wall time), and the load average. ``--turns N`` sets the size; ``--stages DIR`` writes Spark's
event log there and prints the slowest jobs and stages (``bench/spark_stages.py``);
``--scaling`` (default in full mode) reruns the job on ``local[1]`` and ``local[2]``.

The Spark job's own timings are per phase (its steps form few plans, not an action per step);
the near-dup/exact-dedup ratio (default in ``--quick``) is measured after the run by timing
each dedup step alone, as one action over the same cached SFT candidates.
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

import finetune_reference as reference  # bench/, beside this script
from local_broker import cpu_s
from spark_stages import event_log_conf
from spark_stages import report as stage_report

from chatpipe.testing.synthetic_log import generate, to_messages
from spark_jobs.settings import FinetuneSettings, SparkSettings
from transport.archive import write_messages
from transport.settings import KafkaSettings


def spark_dedup_seconds(spark, s, kafka) -> tuple[float, float]:
    """(exact_dedup, near_dedup) seconds, each step alone over the same cached SFT candidates."""
    from pyspark.sql import functions as F

    from spark_jobs.dedup import exact_dedup, near_dedup
    from spark_jobs.deletions import load_erasures
    from spark_jobs.finetune_dataset import erased_inputs, sft_candidates

    turns, feedback, _ = erased_inputs(spark, s, kafka, load_erasures(spark, s, kafka))
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


def jvm_cpu_seconds(spark) -> float:
    """CPU time (user + system) of the Spark JVM so far: in local mode driver and executors are
    this one process. Unlike wall time it hardly depends on what else the shared machine runs."""
    return cpu_s(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())


def spark_run(master: str, s, conf: dict[str, str] | None = None):
    """(session, session start s, job s, result) of the finetune job on a fresh session on
    ``master``, started as ``chatpipe job`` starts it (``jit=auto`` by the archive's size);
    ``result.seconds["jvm cpu"]`` is the JVM's CPU time during the job."""
    from spark_jobs.finetune_dataset import run
    from spark_jobs.preflight import input_bytes
    from spark_jobs.session import build_session

    t = time.perf_counter()
    spark = build_session(SparkSettings(master=master, progress=False, conf=conf or {},
                                        shuffle_partitions=max(4, (os.cpu_count() or 2) * 2)),
                          input_bytes(s, KafkaSettings()))
    start_s = time.perf_counter() - t
    cpu = jvm_cpu_seconds(spark)
    t = time.perf_counter()
    res = run(spark, s, KafkaSettings())
    wall = time.perf_counter() - t
    res.seconds["jvm cpu"] = jvm_cpu_seconds(spark) - cpu
    return spark, start_s, wall, res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="5k turns (CI); default 200k")
    ap.add_argument("--turns", type=int, default=None, help="turns to generate (overrides --quick)")
    ap.add_argument("--master", default="local[*]")
    ap.add_argument("--stages", type=Path, default=None,
                    help="write Spark's event log here and print the slowest jobs and stages of the run")
    ap.add_argument("--scaling", action=argparse.BooleanOptionalAction, default=None,
                    help="also run on local[1] and local[2] (default: on in full mode)")
    ap.add_argument("--dedup-alone", action=argparse.BooleanOptionalAction, default=None,
                    help="time exact/near dedup alone after the run (default: on in --quick)")
    ap.add_argument("--conf", action="append", default=[], metavar="K=V",
                    help="extra Spark conf for every session of the run (repeatable)")
    args = ap.parse_args()
    extra_conf = dict(kv.split("=", 1) for kv in args.conf)
    n = args.turns or (5_000 if args.quick else 200_000)
    scaling = (not args.quick) if args.scaling is None else args.scaling
    dedup_alone = args.quick if args.dedup_alone is None else args.dedup_alone
    work = Path(tempfile.mkdtemp(prefix="bench-finetune-"))
    try:
        log = generate(n_turns=n, seed=3)
        msgs = to_messages(log, "chat.turns", "chat.feedback", partitions=6)
        write_messages(work / "archive", msgs)
        (work / "eval.txt").write_text("\n".join(log.eval_lines))
        s = FinetuneSettings(source="archive", archive_dir=work / "archive", out=work / "spark",
                             eval_files=(work / "eval.txt",))
        n_in = len(log.turns)
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; turns: {n_in}; "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

        conf = {**(event_log_conf(args.stages) if args.stages else {}), **extra_conf}
        spark, start_s, spark_s, res = spark_run(args.master, s, conf)
        if args.stages:
            spark.stop()  # flushes the event log
            print(stage_report(args.stages))
        t, cpu = time.perf_counter(), time.process_time()
        ref, ref_secs = reference.run(msgs, s, work / "python")
        py_s, py_cpu = time.perf_counter() - t, time.process_time() - cpu
        print(f"spark session start: {start_s:.2f} s (not in the ratio); spark side wall incl. start: "
              f"{start_s + spark_s:.2f} s")
        print(f"spark:       {spark_s:8.2f} s  {n_in / spark_s:10.0f} records/s  steps: "
              + ", ".join(f"{k}={v:.2f}s" for k, v in res.seconds.items()))
        print(f"pure-python: {py_s:8.2f} s  {n_in / py_s:10.0f} records/s  steps: "
              + ", ".join(f"{k}={v:.2f}s" for k, v in ref_secs.items()))
        print(f"cpu seconds: spark JVM {res.seconds['jvm cpu']:.1f} s, pure-python {py_cpu:.1f} s "
              f"(ratio {py_cpu / res.seconds['jvm cpu']:.2f}; less load-dependent than wall time)")
        sft_spark = sum(v for k, v in res.card["outputs"].items() if k.startswith("sft/"))
        print(f"sft examples: spark {sft_spark}, pure-python {ref['sft']}")
        if sft_spark != ref["sft"]:
            print("WARNING: spark and pure-python disagree on the number of SFT examples")
        if dedup_alone:
            if args.stages:
                spark, _, _, _ = spark_run(args.master, s.model_copy(update={"out": work / "spark2"}), extra_conf)
            exact_s, near_s = spark_dedup_seconds(spark, s, KafkaSettings())
            print(f"spark dedup steps alone: exact_dedup={exact_s:.2f}s, near_dedup={near_s:.2f}s")
            print(f"near-dup vs exact-dedup time ratio: spark = "
                  f"{near_s / exact_s:.1f}, pure-python = "
                  f"{ref_secs['near_dedup'] / max(ref_secs['exact_dedup'], 1e-9):.1f}")
        if scaling:
            # A master is fixed for a SparkContext's life: a fresh session per master, same input.
            took = {}
            for master in ("local[1]", "local[2]"):
                spark.stop()
                spark, _, took[master], _ = spark_run(master, s.model_copy(update={"out": work / master}), extra_conf)
            print(f"scaling: local[1] {took['local[1]']:.2f} s, local[2] {took['local[2]']:.2f} s "
                  f"(speed-up {took['local[1]'] / took['local[2]']:.2f}x; load average "
                  f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")
        spark.stop()
        print(f"spark/finetune records/s ratio vs pure-python = {py_s / spark_s:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
