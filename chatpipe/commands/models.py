"""``chatpipe model list | show | lineage | canary | promote | rollback``: the model registry
(``chat.models``) from the terminal.

``canary`` / ``promote`` / ``rollback`` change a version's state by hand (the rules are
``transport.model_registry``'s; every change is a whole new record): the workers follow the topic and
load or drop the version, the streams tier routes conversations by it (``transport/model_catalog.py``).

Versions are read from the compacted topic (``transport.model_registry``); lineage from each version's
``lineage.parquet`` in the artifact store (``streams.model_taint.lineage_rows``, the reader the forget
agent uses). Lineage goes both ways: from a version to the dataset and the request and trace ids it was
trained on, and from a request id to the versions its turn helped train.
"""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from chatpipe.commands.common import console, exit_now, with_kafka_flags
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
        exit_now(0 if hits else 1)  # pyarrow's teardown may abort the process after the answer (exit_now)
    found = _find(kafka, version)
    rows = lineage_rows(found.lineage_uri, ["line", "tenant", "request_ids", "trace_ids"])
    typer.echo(f"{found.name}@{found.version}: dataset {found.dataset_uri} (manifest {found.dataset_manifest_id}), "
               f"{rows.num_rows} training rows")
    typer.echo("line\ttenant\trequest_ids\ttrace_ids")
    for line, tenant, requests, traces in zip(*(rows.column(c).to_pylist() for c in rows.column_names)):
        typer.echo(f"{line}\t{tenant}\t{','.join(requests)}\t{','.join(t or '' for t in traces)}")
    exit_now(0)


def _change(kafka, records) -> None:
    from transport.model_registry import publish_model_version

    for record in records:
        publish_model_version(kafka, record)
        typer.echo(f"{record.name}@{record.version}: {record.state.value}{_rollout(record)} — {record.state_reason}")


def _rollout(record) -> str:
    if record.state.value != "CANARY":
        return ""
    rule = (f"rule: decide after {record.rule_min_rated} rated turns each, max drop {record.rule_max_drop:.0%} at "
            f"{record.rule_confidence:.0%}" if record.rule_min_rated else "no rule")
    return f" ({record.canary_share:.0%} of new conversations; {rule})"


def _transition(kafka, rule, ref: str, *args) -> None:
    from transport.model_registry import TransitionError

    try:
        records = rule(_versions(kafka), ref, *args)
    except TransitionError as exc:
        raise typer.BadParameter(str(exc), param_hint="VERSION") from None
    _change(kafka, records)


@model_app.command("canary")
@with_kafka_flags
def canary_cmd(
    version: Annotated[str, typer.Argument(help="NAME@VERSION (CANDIDATE, or a CANARY whose share changes)")],
    share: Annotated[float, typer.Option(help="Share of new conversations it answers, in (0, 1]")] = 0.1,
    min_rated: Annotated[int, typer.Option(help="The rollout rule: decide once the canary and the live version "
                                                "each have this many rated turns; 0 = no rule (decide by hand)")] = 0,
    max_drop: Annotated[float, typer.Option(help="The rule: promote when its thumbs-up rate is not below the live "
                                               "one's by more than this (roll back when below at all)")] = 0.05,
    confidence: Annotated[float, typer.Option(help="The rule: one-sided confidence of both bounds")] = 0.95,
    reason: Annotated[str, typer.Option(help="Why, on the record")] = "canary by hand",
    kafka=None,
) -> None:
    """Serve VERSION to a share of new conversations (chosen by a hash of the conversation key), with a rollout
    rule the streams tier applies to the ratings (--min-rated > 0)."""
    from transport.model_registry import canary

    _transition(kafka, canary, version, share, reason, min_rated, max_drop, confidence)


@model_app.command("promote")
@with_kafka_flags
def promote_cmd(
    version: Annotated[str, typer.Argument(help="NAME@VERSION (a CANARY, a CANDIDATE, or a RETIRED one to go back to)")],
    reason: Annotated[str, typer.Option(help="Why, on the record")] = "promoted by hand",
    kafka=None,
) -> None:
    """Make VERSION the LIVE one of its name; the LIVE version it replaces is RETIRED."""
    from transport.model_registry import promote

    _transition(kafka, promote, version, reason)


@model_app.command("rollback")
@with_kafka_flags
def rollback_cmd(
    version: Annotated[str, typer.Argument(help="NAME@VERSION, a CANARY")],
    reason: Annotated[str, typer.Option(help="Why, on the record")] = "rolled back by hand",
    kafka=None,
) -> None:
    """Take a CANARY out of service (RETIRED): its conversations go back to the LIVE version. A LIVE one is
    rolled back by promoting the version before it."""
    from transport.model_registry import rollback

    _transition(kafka, rollback, version, reason)


def _when(ms: int) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M")


def register(app: typer.Typer) -> None:
    """The commands are on ``chatpipe model`` (engine.py's group, registered there)."""
