"""``chatpipe job ...``: the Spark batch jobs (fine-tuning dataset, usage report).

Builds SparkSettings, the job's settings and KafkaSettings from flags + CHATPIPE_* environment,
then runs the job; pyspark is imported inside the commands so ``chatpipe --help`` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from chatpipe.commands.common import SettingsError, build_settings, console, err_console


def _conf(pairs: list[str]) -> dict[str, str] | None:
    out = {}
    for kv in pairs:
        if "=" not in kv:
            raise SettingsError(f"--conf {kv!r}: expected key=value")
        k, v = kv.split("=", 1)
        out[k] = v
    return out or None


def _common(master, conf, bootstrap_servers, topic_prefix, shuffle_partitions, quiet):
    from spark_jobs.settings import SparkSettings
    from transport.settings import KafkaSettings

    spark_s = build_settings(SparkSettings, master=master, conf=_conf(conf),
                             shuffle_partitions=shuffle_partitions, progress=None if not quiet else False)
    kafka = build_settings(KafkaSettings, bootstrap_servers=bootstrap_servers, topic_prefix=topic_prefix)
    return spark_s, kafka


def _run(job_run, spark_s, settings, kafka):
    """Start the Spark session and run one job with a progress display."""
    from spark_jobs.progress import StepTimer
    from spark_jobs.session import build_session

    return job_run(build_session(spark_s), settings, kafka, StepTimer(enabled=spark_s.progress, console=err_console))


SOURCE = typer.Option(None, help="kafka | archive (default kafka)")
ARCHIVE = typer.Option(None, "--archive-dir", help="Root of the Avro archive (source=archive)")
SINCE = typer.Option(None, help="Start, ISO-8601 (UTC) or epoch ms, inclusive")
UNTIL = typer.Option(None, help="End, ISO-8601 (UTC) or epoch ms, exclusive")
MASTER = typer.Option(None, help="Spark master (default local[*])")
CONF = typer.Option([], "--conf", help="Spark conf key=value (repeat)")
BOOTSTRAP = typer.Option(None, help="Kafka bootstrap servers")
PREFIX = typer.Option(None, help="Topic prefix of the deployment")
SHUFFLE = typer.Option(None, help="spark.sql.shuffle.partitions")
OVERWRITE = typer.Option(None, "--overwrite/--no-overwrite", help="Replace an existing output folder")
QUIET = typer.Option(False, "--quiet", help="No progress display")


def register(app: typer.Typer) -> None:
    job = typer.Typer(help="Spark batch jobs over the logged turns and feedback.", no_args_is_help=True)
    app.add_typer(job, name="job")

    @job.command("finetune-dataset")
    def finetune_dataset(
        out: Path = typer.Option(..., help="Output folder (written atomically)"),
        source: Optional[str] = SOURCE, archive_dir: Optional[Path] = ARCHIVE,
        since: Optional[str] = SINCE, until: Optional[str] = UNTIL,
        eval_file: list[Path] = typer.Option([], "--eval-file", help="Eval set to decontaminate against (repeat)"),
        near_dup_threshold: Optional[float] = typer.Option(None, help="Jaccard similarity that makes a near-duplicate (0.8)"),
        decontam_ngram: Optional[int] = typer.Option(None, help="Words per shared n-gram that marks a leak (13)"),
        validation_fraction: Optional[float] = typer.Option(None, help="Share of conversations in validation (0.05)"),
        max_context_tokens: Optional[int] = typer.Option(None, help="Token budget per example incl. history (2048)"),
        default_system_prompt: Optional[str] = typer.Option(None, help="System message for turns without one"),
        overwrite: Optional[bool] = OVERWRITE, master: Optional[str] = MASTER, conf: list[str] = CONF,
        bootstrap_servers: Optional[str] = BOOTSTRAP, topic_prefix: Optional[str] = PREFIX,
        shuffle_partitions: Optional[int] = SHUFFLE, quiet: bool = QUIET,
    ) -> None:
        """Build SFT (chat JSONL) and preference-pair datasets, with a dataset card."""
        from spark_jobs.finetune_dataset import run
        from spark_jobs.settings import FinetuneSettings

        spark_s, kafka = _common(master, conf, bootstrap_servers, topic_prefix, shuffle_partitions, quiet)
        s = build_settings(FinetuneSettings, out=out, source=source, archive_dir=archive_dir, since=since,
                           until=until, eval_files=tuple(eval_file) or None, near_dup_threshold=near_dup_threshold,
                           decontam_ngram=decontam_ngram, validation_fraction=validation_fraction,
                           max_context_tokens=max_context_tokens, default_system_prompt=default_system_prompt,
                           overwrite=overwrite)
        result = _run(run, spark_s, s, kafka)
        for name, n in result.card["outputs"].items():
            console.print(f"{n:>9}  {result.out / name}")
        console.print(f"card: {result.out / 'dataset_card.md'}")

    @job.command("usage-report")
    def usage_report(
        out: Path = typer.Option(..., help="Output folder (written atomically)"),
        source: Optional[str] = SOURCE, archive_dir: Optional[Path] = ARCHIVE,
        since: Optional[str] = SINCE, until: Optional[str] = UNTIL,
        charts: Optional[bool] = typer.Option(None, "--charts/--no-charts", help="Write PNG charts"),
        overwrite: Optional[bool] = OVERWRITE, master: Optional[str] = MASTER, conf: list[str] = CONF,
        bootstrap_servers: Optional[str] = BOOTSTRAP, topic_prefix: Optional[str] = PREFIX,
        shuffle_partitions: Optional[int] = SHUFFLE, quiet: bool = QUIET,
    ) -> None:
        """Per day and model: requests, tokens, latency percentiles, errors, DLQ counts, active users."""
        from spark_jobs.settings import UsageReportSettings
        from spark_jobs.usage_report import run

        spark_s, kafka = _common(master, conf, bootstrap_servers, topic_prefix, shuffle_partitions, quiet)
        s = build_settings(UsageReportSettings, out=out, source=source, archive_dir=archive_dir, since=since,
                           until=until, charts=charts, overwrite=overwrite)
        result = _run(run, spark_s, s, kafka)
        console.print(f"report: {result / 'usage_report.md'}")
