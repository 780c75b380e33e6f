"""``chatpipe topics apply | list``: the topic catalog (schemas/topics.py) on the broker."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from chatpipe.commands.common import build_settings, console
from chatpipe.options import option
from transport.settings import KafkaSettings  # pydantic only: the flags are made from its fields

topics_app = typer.Typer(help="Create and inspect the catalog's topics.", no_args_is_help=True)

Bootstrap = Annotated[Optional[str], option(KafkaSettings, "bootstrap_servers", "--bootstrap-servers", "-b")]
Prefix = Annotated[Optional[str], option(KafkaSettings, "topic_prefix")]


def _admin(bootstrap_servers, topic_prefix):
    from transport.admin import TopicAdmin
    from transport.settings import KafkaSettings

    admin = TopicAdmin(build_settings(KafkaSettings, bootstrap_servers=bootstrap_servers, topic_prefix=topic_prefix))
    admin.check_reachable()  # no broker: one line in a few seconds, not 30 s of client retries
    return admin


@topics_app.command("apply")
def apply(
    bootstrap_servers: Bootstrap = None,
    topic_prefix: Prefix = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only show what would change")] = False,
) -> None:
    """Create missing topics and align partitions and configs with the catalog (idempotent)."""
    admin = _admin(bootstrap_servers, topic_prefix)
    changes = admin.plan() if dry_run else admin.apply()
    if not changes:
        console.print("topics match the catalog: nothing to change")
    for change in changes:
        console.print(f"{'would ' if dry_run else ''}{change.action:15} {change.topic}  {change.detail}")


@topics_app.command("list")
def list_topics(bootstrap_servers: Bootstrap = None, topic_prefix: Prefix = None) -> None:
    """Each topic with its partitions and end offsets."""
    table = Table()
    for col in ("topic", "partitions", "end offsets", "messages"):
        table.add_column(col)
    for info in _admin(bootstrap_servers, topic_prefix).describe():
        table.add_row(info.name, str(info.partitions), " ".join(map(str, info.end_offsets)), str(info.messages))
    console.print(table)


def register(app: typer.Typer) -> None:
    app.add_typer(topics_app, name="topics")
