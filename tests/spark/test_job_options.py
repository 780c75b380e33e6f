"""``chatpipe job ...`` (typer) and ``spark-submit spark_jobs/<job>.py`` (argparse) take the same options,
one per settings field, under the same flag names: both are built from ``spark_jobs.cli_args``."""

from __future__ import annotations

import os
import types
import typing

import pytest
import typer.main

from spark_jobs.cli_args import FLAG_NAMES, KAFKA_FIELDS, argument_parser, settings_from_options
from spark_jobs.settings import FinetuneSettings, SparkSettings, UsageReportSettings
from transport.settings import KafkaSettings

JOBS = {"finetune-dataset": FinetuneSettings, "usage-report": UsageReportSettings}


def _fields(job_cls) -> dict[str, tuple[type, str]]:
    """Every settings field a job takes -> (settings class, expected flag)."""
    out = {}
    for cls, names in ((job_cls, None), (SparkSettings, None), (KafkaSettings, KAFKA_FIELDS)):
        for name in cls.model_fields:
            if names is None or name in names:
                out[name] = (cls, FLAG_NAMES.get(name, "--" + name.replace("_", "-")))
    return out


def _typer_command(job: str):
    from chatpipe.cli import app

    return typer.main.get_command(app).commands["job"].commands[job]


def _typer_flags(job: str) -> dict[str, str]:
    return {p.name: p.opts[0] for p in _typer_command(job).params if p.opts[0].startswith("--")}


def _argparse_flags(job_cls) -> dict[str, str]:
    return {a.dest: a.option_strings[0] for a in argument_parser(job_cls)._actions if a.option_strings[0] != "-h"}


def _other_value(name: str, cls, tmp_path) -> list[str]:
    """Flag arguments giving field ``name`` a valid value other than its default."""
    info = cls.model_fields[name]
    flag = FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
    special = {"source": "archive", "since": "2026-01-01T00:00:00", "until": "2026-01-02T00:00:00",
               "archive_dir": str(tmp_path / "archive"), "out": str(tmp_path / "out")}
    if name in special:
        return [flag, special[name]]
    ann = info.annotation
    inner = ann
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        inner = next(a for a in typing.get_args(ann) if a is not type(None))
    if inner is bool:
        return [("--no-" + flag[2:]) if info.default else flag]
    if typing.get_origin(inner) is typing.Literal:  # a choice other than the default
        return [flag, next(str(c) for c in typing.get_args(inner) if c != info.default)]
    if typing.get_origin(inner) is dict:
        return [flag, "spark.a=1", flag, "spark.b=2"]
    if typing.get_origin(inner) is tuple:
        return [flag, str(tmp_path / "e1.txt"), flag, str(tmp_path / "e2.txt")]
    if inner is int:
        return [flag, str((info.default or 0) + 3)]
    if inner is float:
        return [flag, str(info.default / 2 if info.default else 0.5)]
    return [flag, f"value-of-{name}"]


@pytest.mark.parametrize("job", sorted(JOBS))
def test_every_settings_field_has_the_same_flag_on_both_interfaces(job):
    """Catches a settings field (new or old) that one interface cannot set, or sets under another
    flag name (the typer options and the spark-submit arguments drifting apart)."""
    expected = {name: flag for name, (_, flag) in _fields(JOBS[job]).items()}
    typer_flags, argparse_flags = _typer_flags(job), _argparse_flags(JOBS[job])
    assert {k: typer_flags.get(k) for k in expected} == expected
    assert {k: argparse_flags.get(k) for k in expected} == expected
    assert typer_flags == argparse_flags  # nothing extra on one side (e.g. --quiet on both)


@pytest.mark.parametrize("job", sorted(JOBS))
def test_both_interfaces_build_the_same_settings_from_the_same_arguments(job, tmp_path, monkeypatch):
    """Catches a flag that parses differently on one interface (repeatable, k=v, --no-x switch, times),
    and a field whose flag exists but never reaches its settings object."""
    for var in [v for v in os.environ if v.startswith("CHATPIPE_")]:
        monkeypatch.delenv(var)
    job_cls = JOBS[job]
    fields = _fields(job_cls)
    argv = [a for name, (cls, _) in fields.items() for a in _other_value(name, cls, tmp_path)]

    ctx = _typer_command(job).make_context(job, list(argv))
    values = dict(ctx.params)
    via_typer = settings_from_options(job_cls, values, quiet=values.pop("quiet"))
    via_argparse = settings_from_options(job_cls, vars(argument_parser(job_cls).parse_args(argv)))
    assert via_typer == via_argparse
    objects = dict(zip((SparkSettings, job_cls, KafkaSettings), via_typer))
    for name, (cls, _) in fields.items():
        assert getattr(objects[cls], name) != cls.model_fields[name].get_default(call_default_factory=True), name
