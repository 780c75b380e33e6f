"""`chatpipe batch list | show BATCH [--watch]`: the Batch API's batches as ``chat.batches`` holds them
(transport/batch_book.py), for an operator: every tenant's, with their progress.

Read from Kafka, not through a gateway (no API key needed; the topic's readers are the gateways and this
command, docs/security_broker.md). ``show --watch`` follows one batch with a progress bar until it ends.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Optional

import typer

from chatpipe.commands.common import console, print_error, with_kafka_flags

batch_app = typer.Typer(help="Batches of the Batch API (chat.batches): list them, show one with its progress.",
                        no_args_is_help=True)


def _book(kafka):
    from transport.batch_book import BatchBook

    return BatchBook(kafka).load()


def _when(seconds: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds)) if seconds else "-"


@batch_app.command("list")
@with_kafka_flags
def list_batches(
    tenant: Annotated[Optional[str], typer.Option(help="Only this tenant's batches")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One OpenAI batch object per line")] = False,
    kafka=None,
) -> None:
    """Every batch, newest first: status, lines done of all, the tenant, when it was made and ends."""
    from rich.table import Table

    from gateway.batches import batch_object

    jobs = _book(kafka).jobs(tenant)
    if as_json:
        for job in jobs:
            typer.echo(json.dumps({**batch_object(job), "tenant": job.tenant}))
        return
    if not jobs:
        console.print("no batches on chat.batches: POST /v1/batches makes one (docs/gateway.md \"Batches\")")
        return
    table = Table("batch", "status", "done", "failed", "tenant", "endpoint", "created", "expires")
    for job in jobs:
        table.add_row(job.batch_id, job.status.value.lower(), f"{job.completed + job.failed}/{job.total}",
                      str(job.failed), job.tenant, job.endpoint, _when(job.created_at), _when(job.expires_at))
    console.print(table)


@batch_app.command("show")
@with_kafka_flags
def show(
    batch_id: Annotated[str, typer.Argument(help="The batch's id (batch_...)")],
    watch: Annotated[bool, typer.Option("--watch", help="Follow it with a progress bar until it ends")] = False,
    kafka=None,
) -> None:
    """One batch as OpenAI's batch object (with its tenant); with --watch a progress bar until it ends."""
    from gateway.batches import batch_object
    from transport.batch_book import ENDED

    book = _book(kafka)
    job = book.get(batch_id)
    if job is None:
        print_error(f"no batch {batch_id} on chat.batches (`chatpipe batch list`)")
        raise typer.Exit(1)
    if watch and job.status not in ENDED:
        job = _watch(kafka, book, batch_id)
    typer.echo(json.dumps({**batch_object(job), "tenant": job.tenant}, indent=1))


def _watch(kafka, book, batch_id: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from transport.batch_book import ENDED

    book.start(lambda exc: None)  # follow the topic from here on
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            job = book.get(batch_id)
            bar = progress.add_task(f"{batch_id} {job.status.value.lower()}", total=job.total or None)
            while job.status not in ENDED:
                time.sleep(0.5)
                job = book.get(batch_id)
                progress.update(bar, completed=job.completed + job.failed,
                                description=f"{batch_id} {job.status.value.lower()}")
            return job
    finally:
        book.close()


def register(app: typer.Typer) -> None:
    app.add_typer(batch_app, name="batch")
