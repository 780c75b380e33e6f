"""``chatpipe job ...``: the Spark batch jobs (fine-tuning dataset, usage report).

The options are not written out here: each command's parameters are built from
``spark_jobs.cli_args.job_options`` (one flag per settings field, the same flags as
``spark-submit spark_jobs/<job>.py``). A run checks its inputs and output folder first
(``spark_jobs.preflight``: one-line errors in seconds), then starts Spark. pyspark is imported
inside the commands so ``chatpipe --help`` stays instant.
"""

from __future__ import annotations

import inspect
import time
from typing import Optional

import typer

from chatpipe.commands.common import console, err_console, with_parameters

FINETUNE, USAGE = "finetune-dataset", "usage-report"


def _parameters(job_cls) -> list[inspect.Parameter]:
    from spark_jobs.cli_args import QUIET_FLAG, job_options

    params = []
    for opt in job_options(job_cls):
        if opt.kind == "switch":
            flags = f"{opt.flag}/--no-{opt.flag[2:]}"
            default, annotation = typer.Option(None, flags, help=opt.help, show_default=False), Optional[bool]
        elif opt.kind in ("repeat", "pairs"):
            default = typer.Option([], opt.flag, help=opt.help, show_default=False, metavar=opt.metavar)
            annotation = list[str]
        else:
            default = typer.Option(None, opt.flag, help=opt.help, show_default=False, metavar=opt.metavar)
            annotation = Optional[str]
        params.append(inspect.Parameter(opt.field, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=annotation))
    params.append(inspect.Parameter("quiet", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                                    default=typer.Option(False, QUIET_FLAG, help="No progress display (= --no-progress)")))
    return params


def _prepare(job: str, job_cls, values: dict):
    """Settings from the options, then the checks that need no Spark (errors raise, warnings print)."""
    from spark_jobs.cli_args import settings_from_options
    from spark_jobs.preflight import check_inputs, check_output

    spark_s, s, kafka = settings_from_options(job_cls, values, quiet=values.pop("quiet", False))
    check_output(s.out, s.overwrite, job)
    warnings = check_inputs(s, kafka)
    for line in warnings:
        err_console.print(f"[yellow]{line}[/]", highlight=False, soft_wrap=True)
    return spark_s, s, kafka, warnings


def _run(job_run, spark_s, settings, kafka):
    """Start the Spark session and run one job with a progress display."""
    from spark_jobs.preflight import input_bytes
    from spark_jobs.progress import StepTimer
    from spark_jobs.session import build_session

    spark = build_session(spark_s, input_bytes(settings, kafka))
    return job_run(spark, settings, kafka, StepTimer(enabled=spark_s.progress, console=err_console))


def _parquet_rows(folder) -> int:
    import pyarrow.parquet as pq

    return sum(pq.read_metadata(p).num_rows for p in folder.rglob("*.parquet"))


def register(app: typer.Typer) -> None:
    from spark_jobs.settings import FinetuneSettings, UsageReportSettings

    job = typer.Typer(help="Spark batch jobs over the logged turns and feedback.", no_args_is_help=True)
    app.add_typer(job, name="job")

    def finetune_dataset(**values) -> None:
        """Build SFT (chat JSONL) and preference-pair datasets, with a dataset card."""
        from spark_jobs.finetune_dataset import run
        from spark_jobs.preflight import no_data_warning

        spark_s, s, kafka, warned = _prepare(FINETUNE, FinetuneSettings, values)
        started = time.monotonic()
        result = _run(run, spark_s, s, kafka)
        for name, n in result.card["outputs"].items():
            console.print(f"{n:>9}  {result.out / name}")
        console.print(f"card: {result.out / 'dataset_card.md'}  ({time.monotonic() - started:.0f} s)")
        for line in result.warnings:  # e.g. undecodable Deletions: the build goes on without them
            err_console.print(f"[yellow]warning: {line}[/]", highlight=False, soft_wrap=True)
        if not warned and result.card["input"]["turns_read"] == 0:
            err_console.print(f"[yellow]{no_data_warning(s, kafka)}[/]", highlight=False, soft_wrap=True)

    def usage_report(**values) -> None:
        """Per day and model: requests, tokens, latency percentiles, errors, DLQ counts, active users."""
        from spark_jobs.preflight import no_data_warning
        from spark_jobs.usage_report import run

        spark_s, s, kafka, warned = _prepare(USAGE, UsageReportSettings, values)
        result = _run(run, spark_s, s, kafka)
        console.print(f"report: {result / 'usage_report.md'}")
        if not warned and _parquet_rows(result / "usage.parquet") == 0:
            err_console.print(f"[yellow]{no_data_warning(s, kafka)}[/]", highlight=False, soft_wrap=True)

    # body(**values) with keyword parameters from the job's options
    job.command(FINETUNE)(with_parameters(finetune_dataset, _parameters(FinetuneSettings)))
    job.command(USAGE)(with_parameters(usage_report, _parameters(UsageReportSettings)))
