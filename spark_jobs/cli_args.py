"""The options of the batch jobs, defined once: ``chatpipe job ...`` (typer) and ``spark-submit
spark_jobs/<job>.py`` (argparse) are both built from :func:`job_options`.

The options *are* the settings fields: every field of ``SparkSettings``, of the job's settings
class and the Kafka connection fields in ``KAFKA_FIELDS`` is one flag, named after the field
(``near_dup_threshold`` -> ``--near-dup-threshold``) unless ``FLAG_NAMES`` says otherwise, with
the field's description as help. A new settings field is a new flag on both interfaces, with
nothing to add here (tests/spark/test_job_options.py checks both against the fields). Values
are passed to the settings classes as given (strings), so pydantic parses and checks them the
same way whichever interface they came through, and CHATPIPE_* variables fill what no flag set.

Not here: running a job (chatpipe/commands/jobs.py, the jobs' ``main``).
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from spark_jobs.errors import OptionError
from spark_jobs.settings import SparkSettings

#: The transport's KafkaSettings fields a job takes as flags (the others: their CHATPIPE_* variables).
KAFKA_FIELDS = ("bootstrap_servers", "topic_prefix")
#: Flags that are not the field name with dashes (repeatable ones are singular).
FLAG_NAMES = {"eval_files": "--eval-file"}
#: ``--quiet`` is ``--no-progress`` (kept: scripts use it).
QUIET_FLAG = "--quiet"


@dataclass(frozen=True)
class JobOption:
    """One flag: which settings object and field it fills, and how it is given."""

    group: str  # "spark" | "job" | "kafka"
    field: str
    flag: str
    kind: str  # "value" | "switch" (--x/--no-x) | "repeat" (list) | "pairs" (repeat k=v -> dict)
    help: str
    required: bool
    metavar: str = "TEXT"


def _kind(annotation) -> str:
    if annotation is bool:
        return "switch"
    origin = typing.get_origin(annotation)
    if origin is dict:
        return "pairs"
    if origin in (tuple, list):
        return "repeat"
    return "value"


def _metavar(name: str, annotation) -> str:
    if name in ("since", "until"):
        return "TIME"
    inner = annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(inner) is typing.Literal:
        return "|".join(map(str, typing.get_args(inner)))
    if typing.get_origin(inner) in (tuple, list):
        inner = typing.get_args(inner)[0]
    if typing.get_origin(inner) is dict:
        return "KEY=VALUE"
    return {int: "INT", float: "FLOAT", Path: "PATH"}.get(inner, "TEXT")


def _help(cls, name: str, info, repeat: str = "") -> str:
    """The field's description, then ``[env CHATPIPE_...; default ...]`` like every chatpipe command."""
    env = f"{cls.model_config.get('env_prefix', '')}{name.upper()}"
    default = info.default
    shown = default is not PydanticUndefined and default not in (None, (), {}, "") and info.default_factory is None
    required = " (required)" if info.is_required() else ""
    return f"{info.description or ''}{repeat}{required} [env {env}" + (f"; default {default}]" if shown else "]")


def _options_of(group: str, cls: type[BaseModel], names=None) -> list[JobOption]:
    out = []
    for name, info in cls.model_fields.items():
        if names is not None and name not in names:
            continue
        kind = _kind(info.annotation)
        help_ = _help(cls, name, info, {"pairs": " (repeat key=value)", "repeat": " (repeat)"}.get(kind, ""))
        out.append(JobOption(group, name, FLAG_NAMES.get(name, "--" + name.replace("_", "-")), kind, help_,
                             info.is_required(), _metavar(name, info.annotation)))
    return out


def job_options(job_cls: type[BaseModel]) -> list[JobOption]:
    """Every option of the job whose settings class is ``job_cls``: job, Spark, then Kafka fields."""
    from transport.settings import KafkaSettings

    opts = (_options_of("job", job_cls) + _options_of("spark", SparkSettings)
            + _options_of("kafka", KafkaSettings, KAFKA_FIELDS))
    fields = [o.field for o in opts]
    assert len(set(fields)) == len(fields), f"a field name is in two settings groups: {fields}"
    return opts


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    for kv in values:
        if "=" not in kv:
            raise OptionError(f"{flag} {kv!r}: expected key=value")
    return dict(kv.split("=", 1) for kv in values)


def _build(cls, values: dict):
    try:
        return cls(**values)
    except ValidationError as exc:
        prefix = cls.model_config.get("env_prefix", "")
        problems = []
        for e in exc.errors():
            name = ".".join(map(str, e["loc"]))
            if e["type"] == "missing":
                problems.append(f"missing {FLAG_NAMES.get(name, '--' + name.replace('_', '-'))} "
                                f"(or {prefix}{name.upper()})")
            else:
                problems.append(f"{name}: {e['msg']}")
        raise OptionError(f"invalid {cls.__name__}: {'; '.join(problems)}") from None


def settings_from_options(job_cls, values: dict[str, typing.Any], quiet: bool = False):
    """(SparkSettings, job settings, KafkaSettings) from option values by field name.

    A value of None (or an empty repeat) was not given: the environment, then the field's
    default, decide. Raises :class:`OptionError` (one line) on a value a field cannot take.
    """
    from transport.settings import KafkaSettings

    given: dict[str, dict] = {"job": {}, "spark": {}, "kafka": {}}
    for opt in job_options(job_cls):
        value = values.get(opt.field)
        if value is None or (opt.kind in ("repeat", "pairs") and not value):
            continue
        if opt.kind == "pairs":
            value = _pairs(list(value), opt.flag)
        elif opt.kind == "repeat":
            value = tuple(value)
        given[opt.group][opt.field] = value
    if quiet:
        given["spark"]["progress"] = False
    return (_build(SparkSettings, given["spark"]), _build(job_cls, given["job"]),
            _build(KafkaSettings, given["kafka"]))


def argument_parser(job_cls) -> argparse.ArgumentParser:
    """The argparse parser of ``spark-submit spark_jobs/<job>.py``, from :func:`job_options`."""
    parser = argparse.ArgumentParser(description=(job_cls.__doc__ or "").strip().splitlines()[0])
    for opt in job_options(job_cls):
        if opt.kind == "switch":
            parser.add_argument(opt.flag, dest=opt.field, action=argparse.BooleanOptionalAction, default=None,
                                help=opt.help)
        elif opt.kind in ("repeat", "pairs"):
            parser.add_argument(opt.flag, dest=opt.field, action="append", default=[], help=opt.help,
                                metavar=opt.metavar)
        else:
            parser.add_argument(opt.flag, dest=opt.field, default=None, help=opt.help, metavar=opt.metavar)
    parser.add_argument(QUIET_FLAG, action="store_true", help="No progress display (= --no-progress)")
    return parser


def parse_job_args(job_cls, argv: list[str] | None):
    """(SparkSettings, job settings, KafkaSettings) from ``argv`` and the environment."""
    args = vars(argument_parser(job_cls).parse_args(argv))
    return settings_from_options(job_cls, args, quiet=args.pop("quiet", False))


__all__ = ["JobOption", "job_options", "settings_from_options", "argument_parser", "parse_job_args",
           "KAFKA_FIELDS", "FLAG_NAMES", "QUIET_FLAG"]
