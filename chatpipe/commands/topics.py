"""``chatpipe topics apply | list``: the topic catalog (schemas/topics.py) on the broker."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from chatpipe.commands.common import BootstrapServers, TopicPrefix, build_settings, console, table

topics_app = typer.Typer(help="Create and inspect the catalog's topics.", no_args_is_help=True)



def _admin(bootstrap_servers, topic_prefix):
    from transport.admin import TopicAdmin
    from transport.settings import KafkaSettings

    admin = TopicAdmin(build_settings(KafkaSettings, bootstrap_servers=bootstrap_servers, topic_prefix=topic_prefix))
    admin.check_reachable()  # no broker: one line in a few seconds, not 30 s of client retries
    return admin


@topics_app.command("apply")
def apply(
    bootstrap_servers: BootstrapServers = None,
    topic_prefix: TopicPrefix = None,
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
def list_topics(bootstrap_servers: BootstrapServers = None, topic_prefix: TopicPrefix = None) -> None:
    """Each topic with its partitions and end offsets."""
    console.print(topics_table(_admin(bootstrap_servers, topic_prefix).describe()))


def topics_table(topics: list, title: str | None = None) -> Table:
    """Each topic with its partitions, end offsets and messages (also in `chatpipe status`)."""
    out = table("topic", "partitions", "end offsets", "messages", title=title)
    for info in topics:
        out.add_row(info.name, str(info.partitions), " ".join(map(str, info.end_offsets)), str(info.messages))
    return out


def register(app: typer.Typer) -> None:
    app.add_typer(topics_app, name="topics")
