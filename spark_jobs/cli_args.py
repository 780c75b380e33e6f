"""Command-line arguments for ``spark-submit spark_jobs/<job>.py``: one flag per settings field.

The ``chatpipe job ...`` commands (typer) are the main interface; this keeps the jobs runnable
under spark-submit without importing the CLI package. Flags are the field names with dashes
(``--near-dup-threshold 0.9``); ``--conf k=v`` and ``--eval-file`` repeat.
"""

from __future__ import annotations

import argparse

from spark_jobs.settings import SparkSettings


def _flags(parser: argparse.ArgumentParser, cls, skip=()) -> list[str]:
    names = []
    for name, info in cls.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        if info.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(flag, dest=name, default=None, help=info.description)
        names.append(name)
    return names


def parse_job_args(job_cls, argv: list[str] | None):
    """(SparkSettings, job settings, KafkaSettings) from ``argv`` and the environment."""
    from transport.settings import KafkaSettings

    parser = argparse.ArgumentParser(description=job_cls.__doc__)
    job_names = _flags(parser, job_cls, skip={"eval_files"})
    if "eval_files" in job_cls.model_fields:
        parser.add_argument("--eval-file", dest="eval_files", action="append", default=None)
    spark_names = _flags(parser, SparkSettings, skip={"conf"})
    parser.add_argument("--conf", action="append", default=[], help="Spark conf k=v (repeat)")
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--topic-prefix", default=None)
    args = vars(parser.parse_args(argv))

    def pick(names):
        return {n: args[n] for n in names if args.get(n) is not None}

    conf = dict(kv.split("=", 1) for kv in args["conf"])
    spark = SparkSettings(**pick(spark_names), **({"conf": conf} if conf else {}))
    job = job_cls(**pick(job_names + (["eval_files"] if "eval_files" in args else [])))
    kafka = KafkaSettings(**pick(["bootstrap_servers", "topic_prefix"]))
    return spark, job, kafka
