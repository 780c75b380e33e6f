"""``chatpipe model list | show | lineage``: the model registry (``chat.models``) from the terminal.

Versions are read from the compacted topic (``transport.model_registry``); lineage from each version's
``lineage.parquet`` in the artifact store (``streams.model_taint.lineage_rows``, the reader the forget
agent uses). Lineage goes both ways: from a version to the dataset and the request and trace ids it was
trained on, and from a request id to the versions its turn helped train.
"""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from chatpipe.commands.common import console, with_kafka_flags
from chatpipe.commands.engine import model_app


def _versions(kafka):
    from transport.admin import TopicAdmin
    from transport.model_registry import read_model_versions

    TopicAdmin(kafka).check_reachable()
    return read_model_versions(kafka)


def _find(kafka, ref: str):
    from transport.model_registry import find_version

    try:
        found = find_version(_versions(kafka), ref)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="VERSION") from None
    if found is None:
        raise typer.BadParameter(f"no model version {ref} on the registry (`chatpipe model list`)", param_hint="VERSION")
    return found


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


@model_app.command("list")
@with_kafka_flags
def list_versions(
    name: Annotated[Optional[str], typer.Option(help="Only this model name's versions")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per version")] = False,
    kafka=None,
) -> None:
    """Every model version on the registry (chat.models): state, tenant scope, rows, eval loss."""
    from rich.table import Table

    from schemas.codec import to_avro_dict

    versions = sorted(_versions(kafka).values(), key=lambda v: (v.name, v.version))
    versions = [v for v in versions if name is None or v.name == name]
    if as_json:
        for v in versions:
            typer.echo(json.dumps(to_avro_dict(v), default=str))
        return
    if not versions:
        console.print("no model versions on the registry: `chatpipe train lora` publishes one")
        return
    table = Table("version", "state", "tenant", "rows", "eval loss before → after", "base model", "created")
    for v in versions:
        table.add_row(f"{v.name}@{v.version}", v.state.value, v.tenant or "shared", str(v.training_rows),
                      f"{_loss(v.eval_loss_before)} → {_loss(v.eval_loss)}", v.base_model, _when(v.created_at))
    console.print(table)


@model_app.command("show")
@with_kafka_flags
def show(
    version: Annotated[str, typer.Argument(help="NAME@VERSION, or NAME for its newest version")],
    kafka=None,
) -> None:
    """One version's record: artifact, hashes, dataset, hyperparameters, losses, state and why."""
    from schemas.codec import to_avro_dict

    record = to_avro_dict(_find(kafka, version))
    record["hyperparameters"] = {k: json.loads(v) for k, v in record["hyperparameters"].items()}
    typer.echo(json.dumps(record, indent=1, default=str))


@model_app.command("lineage")
@with_kafka_flags
def lineage(
    version: Annotated[Optional[str], typer.Argument(help="NAME@VERSION: what it was trained on")] = None,
    request_id: Annotated[Optional[str], typer.Option("--request-id", help="Which versions this request's turn "
                                                      "helped train (instead of VERSION)")] = None,
    kafka=None,
) -> None:
    """Lineage both ways: a version's dataset, rows, request ids and trace ids; or a request id's versions."""
    from streams.model_taint import lineage_rows

    if (version is None) == (request_id is None):
        raise typer.BadParameter("give a VERSION or --request-id, one of the two")
    if request_id is not None:
        hits = []
        for v in sorted(_versions(kafka).values(), key=lambda v: (v.name, v.version)):
            rows = lineage_rows(v.lineage_uri, ["line"], request_id=request_id)
            if rows.num_rows:
                hits.append(v)
                typer.echo(f"{v.name}@{v.version}\t{v.state.value}\trows {rows.column('line').to_pylist()} of "
                           f"{v.dataset_uri}/sft/train.jsonl")
        if not hits:
            typer.echo(f"no version on the registry was trained on request {request_id}", err=True)
            raise typer.Exit(1)
        return
    found = _find(kafka, version)
    rows = lineage_rows(found.lineage_uri, ["line", "tenant", "request_ids", "trace_ids"])
    typer.echo(f"{found.name}@{found.version}: dataset {found.dataset_uri} (manifest {found.dataset_manifest_id}), "
               f"{rows.num_rows} training rows")
    typer.echo("line\ttenant\trequest_ids\ttrace_ids")
    for line, tenant, requests, traces in zip(*(rows.column(c).to_pylist() for c in rows.column_names)):
        typer.echo(f"{line}\t{tenant}\t{','.join(requests)}\t{','.join(t or '' for t in traces)}")


def _when(ms: int) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M")


def register(app: typer.Typer) -> None:
    """The commands are on ``chatpipe model`` (engine.py's group, registered there)."""
