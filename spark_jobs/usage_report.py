"""``chatpipe job usage-report``: per UTC day and model, from chat.turns and chat.dlq.

Figures per (day of ``created_at``, model): requests, tokens in and out, TTFT and total
latency p50/p95/p99 (exact percentiles; TTFT only from turns written with schema v2 or later,
v1 did not record it), errors (finish reason ERROR/TIMEOUT/OVERLOADED), cancelled, active
users (distinct (tenant, user_id)). Per day: dead letters by component (chat.dlq) and undecodable
turns. Per tenant, over the whole range: requests, tokens in and out, prompt tokens the engine took
from its prefix cache (ConversationTurn v5 ``cached_tokens``: OpenAI's ``cached_tokens``) and their
share of the tokens in; a turn written before v5 decodes with the field's default 0 (its cache use
was not recorded), so the share over such a range is a lower bound. Outputs: ``usage.parquet``,
``tenants.parquet``, ``dlq.parquet``, ``usage_report.md``, and PNG charts (requests, tokens, p95
latency per day and model) when there is data to chart; the Markdown links only the charts written,
and says "no data" otherwise.

A turn or dead letter delivered more than once (at-least-once producers, a redelivery after a
crash) is counted once: one row per ``event_id``, the earliest by ``created_at`` (the dataset
job's exact dedup keeps one copy the same way).

Also runnable as ``spark-submit spark_jobs/usage_report.py --out DIR [--source ...]``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from spark_jobs.decode import decode_records
from spark_jobs.filters import ERROR_FINISH
from spark_jobs.finetune_dataset import read_topic
from spark_jobs.progress import StepTimer
from spark_jobs.settings import UsageReportSettings
from spark_jobs.preflight import check_inputs, input_bytes, job_output
from spark_jobs.writers import write_parquet

JOB = "usage-report"

PCTS = (0.5, 0.95, 0.99)


def _day(col) -> F.Column:
    return F.date_format(F.timestamp_millis(col), "yyyy-MM-dd")


def one_per_event(df: DataFrame) -> DataFrame:
    """``df`` with one row per ``event_id``: the earliest (created_at, then Kafka timestamp).

    Copies of one delivery are the same record, so which one is kept changes no figure. (Not the
    Kafka position columns: a DeadLetter has record fields of the same names.)
    """
    order = Window.partitionBy("event_id").orderBy("created_at", "kafka_ts")
    return df.withColumn("_copy", F.row_number().over(order)).where("_copy = 1").drop("_copy")


def usage_table(turns: DataFrame) -> DataFrame:
    ttft = F.when(F.col("writer_version") >= 2, F.col("ttft_ms"))
    aggs = [F.count("*").alias("requests"), F.sum("tokens_in").alias("tokens_in"),
            F.sum("tokens_out").alias("tokens_out")]
    aggs += [F.percentile(ttft, p).alias(f"ttft_p{int(p * 100)}_ms") for p in PCTS]
    aggs += [F.percentile("total_ms", p).alias(f"total_p{int(p * 100)}_ms") for p in PCTS]
    aggs += [F.sum(F.col("finish_reason").isin(*ERROR_FINISH).cast("int")).alias("errors"),
             F.sum((F.col("finish_reason") == "CANCELLED").cast("int")).alias("cancelled"),
             # a user is (tenant, user_id): two tenants' "ada" are two people
             F.countDistinct("tenant", "user_id").alias("active_users")]
    return turns.groupBy(_day(F.col("created_at")).alias("day"), "model").agg(*aggs)


def tenant_table(turns: DataFrame) -> DataFrame:
    """Per tenant: requests, tokens in and out, ``cached_tokens`` and ``cached_share`` (cached / tokens
    in; null for a tenant with no tokens in)."""
    tokens_in, cached = F.sum("tokens_in"), F.sum("cached_tokens")
    return turns.groupBy("tenant").agg(
        F.count("*").alias("requests"), tokens_in.alias("tokens_in"), F.sum("tokens_out").alias("tokens_out"),
        cached.alias("cached_tokens"), F.when(tokens_in > 0, cached / tokens_in).alias("cached_share"))


def dlq_table(dead: DataFrame, undecodable_turns: DataFrame) -> DataFrame:
    a = dead.groupBy(_day(F.col("created_at")).alias("day"), "component").count()
    b = undecodable_turns.groupBy(_day(F.col("source_timestamp")).alias("day")).count() \
        .withColumn("component", F.lit("undecodable chat.turns"))
    return a.unionByName(b).withColumnRenamed("count", "dead_letters")


def _markdown(usage, dlq, charts: list[str], tenants=None) -> str:
    """The report; links exactly the ``charts`` written (names without .png)."""
    lines = ["# Usage report", "", "Per UTC day and model (latencies in ms).", ""]
    if len(usage):
        cols = list(usage.columns)
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(f"{v:.0f}" if isinstance(v, float) else str(v) for v in r) + " |"
                  for _, r in usage.iterrows()]
    else:
        lines.append("No data: no turns in the time range.")
    if tenants is not None and len(tenants):
        lines += ["", "## Per tenant", "",
                  "cached_tokens: prompt tokens taken from the engine's prefix cache (turns before "
                  "ConversationTurn v5 count 0); cached_share: of tokens_in.", "",
                  "| tenant | requests | tokens_in | tokens_out | cached_tokens | cached_share |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r.tenant} | {r.requests} | {r.tokens_in} | {r.tokens_out} | {r.cached_tokens} | "
                  f"{_share(r.cached_share)} |" for r in tenants.itertuples()]
    lines += ["", "## Dead letters per day", ""]
    if len(dlq):
        lines += ["| day | component | dead_letters |", "|---|---|---:|"]
        lines += [f"| {r.day} | {r.component} | {r.dead_letters} |" for r in dlq.itertuples()]
    else:
        lines.append("No data: no dead letters in the time range.")
    lines += ["", "## Charts", ""]
    lines.append(" ".join(f"![{name}]({name}.png)" for name in charts) if charts else
                 "No charts: " + ("no data to chart." if not len(usage) else "not asked for (--no-charts)."))
    lines.append("")
    return "\n".join(lines)


def _share(value) -> str:
    """A share as a percentage; "-" for none (a tenant with no tokens in: null, NaN in pandas)."""
    return f"{value:.1%}" if value is not None and math.isfinite(value) else "-"


def _charts(usage, folder: Path) -> list[str]:
    """Write the PNG charts of ``usage`` (not empty) into ``folder``; returns their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, cols, title in (("requests", ["requests"], "requests per day"),
                              ("tokens", ["tokens_in", "tokens_out"], "tokens per day"),
                              ("latency_p95", ["ttft_p95_ms", "total_p95_ms"], "p95 latency (ms)")):
        fig, ax = plt.subplots(figsize=(8, 4))
        for model, group in usage.groupby("model"):
            for col in cols:
                ax.plot(group["day"], group[col], marker="o", label=f"{model} {col}")
        ax.set_title(title)
        ax.legend(fontsize=7)
        fig.autofmt_xdate()
        fig.savefig(folder / f"{name}.png", dpi=100)
        plt.close(fig)
        written.append(name)
    return written


def run(spark: SparkSession, s: UsageReportSettings, kafka, timer: StepTimer | None = None) -> Path:
    timer = timer or StepTimer(enabled=False)
    check_inputs(s, kafka)  # one-line errors before any Spark work (spark_jobs.preflight)
    with job_output(s.out, s.overwrite, JOB) as tmp:
        with timer.step("read+decode"):
            t = decode_records(read_topic(spark, s, kafka, s.turns_topic), "ConversationTurn")
            d = decode_records(read_topic(spark, s, kafka, s.dlq_topic), "DeadLetter")
        with timer.step("aggregate"):
            turns = one_per_event(t.kept)
            usage = usage_table(turns).orderBy("day", "model")
            tenants = tenant_table(turns).orderBy("tenant")
            dlq = dlq_table(one_per_event(d.kept), t.dropped).orderBy("day", "component")
            usage_pd, tenants_pd, dlq_pd = usage.toPandas(), tenants.toPandas(), dlq.toPandas()
        with timer.step("write"):
            write_parquet(usage, ["day", "model"], tmp / "usage.parquet")
            write_parquet(tenants, ["tenant"], tmp / "tenants.parquet")
            write_parquet(dlq, ["day", "component"], tmp / "dlq.parquet")
            charts = _charts(usage_pd, tmp) if s.charts and len(usage_pd) else []
            (tmp / "usage_report.md").write_text(_markdown(usage_pd, dlq_pd, charts, tenants_pd), encoding="utf-8")
    return Path(s.out).resolve()


def main(argv: list[str] | None = None) -> int:
    from spark_jobs.cli_args import parse_job_args
    from spark_jobs.session import build_session

    spark_s, job_s, kafka = parse_job_args(UsageReportSettings, argv)
    for line in check_inputs(job_s, kafka):
        print(line, file=sys.stderr)
    out = run(build_session(spark_s, input_bytes(job_s, kafka)), job_s, kafka, StepTimer(enabled=spark_s.progress))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
