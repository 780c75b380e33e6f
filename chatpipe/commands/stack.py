"""``chatpipe up | down | status``: the local Kafka broker and what it holds."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from chatpipe.commands.common import build_settings, console

StateDir = Annotated[Optional[Path], typer.Option("--state-dir", help="State folder [env CHATPIPE_STATE_DIR; default .chatpipe]")]
KafkaPort = Annotated[Optional[int], typer.Option("--kafka-port", help="Broker client port [env CHATPIPE_KAFKA_PORT; default 9092]")]
ControllerPort = Annotated[Optional[int], typer.Option("--controller-port", help="KRaft controller port [env CHATPIPE_CONTROLLER_PORT; default 9093]")]


def _stack(state_dir, kafka_port, controller_port):
    from infra.local_kafka import LocalKafka
    from infra.settings import StackSettings

    settings = build_settings(StackSettings, state_dir=state_dir, kafka_port=kafka_port,
                              controller_port=controller_port)
    return settings, LocalKafka(settings)


def up(state_dir: StateDir = None, kafka_port: KafkaPort = None, controller_port: ControllerPort = None) -> None:
    """Start the local Kafka broker in the background, wait until it answers, apply the topic catalog."""
    from transport.admin import TopicAdmin
    from transport.settings import KafkaSettings

    settings, kafka = _stack(state_dir, kafka_port, controller_port)
    with console.status(f"starting Kafka on {settings.bootstrap_servers} (first run fetches jars with mvn)..."):
        started = kafka.up()
    status = kafka.status()
    verb = "started" if started else "already running"
    console.print(f"Kafka {status.version} {verb}: pid {status.pid}, {status.bootstrap_servers}, state {status.state_dir}")
    changes = TopicAdmin(build_settings(KafkaSettings, bootstrap_servers=settings.bootstrap_servers)).apply()
    console.print(f"topic catalog applied: {len(changes)} change(s)")
    for change in changes:
        console.print(f"  {change.action:15} {change.topic}  {change.detail}")


def down(state_dir: StateDir = None, kafka_port: KafkaPort = None, controller_port: ControllerPort = None) -> None:
    """Stop the local Kafka broker cleanly (SIGTERM; SIGKILL only after the stop timeout)."""
    _, kafka = _stack(state_dir, kafka_port, controller_port)
    if kafka.down():
        console.print("Kafka stopped")
    else:
        console.print("Kafka was not running")


def status(state_dir: StateDir = None, kafka_port: KafkaPort = None, controller_port: ControllerPort = None) -> None:
    """Show what runs, on which ports, and each topic with partitions and end offsets."""
    from transport.admin import TopicAdmin
    from transport.settings import KafkaSettings

    settings, kafka = _stack(state_dir, kafka_port, controller_port)
    st = kafka.status()
    table = Table(title="chatpipe local stack")
    for col in ("service", "state", "pid", "address", "state folder"):
        table.add_column(col)
    table.add_row(f"kafka {st.version}", "running" if st.running else "stopped", str(st.pid or "-"),
                  f"{st.bootstrap_servers} (controller :{st.controller_port})", str(st.state_dir))
    console.print(table)
    if not st.running:
        raise typer.Exit(code=1)
    topics = Table(title="topics")
    for col in ("topic", "partitions", "end offsets", "messages"):
        topics.add_column(col)
    for info in TopicAdmin(build_settings(KafkaSettings, bootstrap_servers=settings.bootstrap_servers)).describe():
        topics.add_row(info.name, str(info.partitions), " ".join(map(str, info.end_offsets)), str(info.messages))
    console.print(topics)


def register(app: typer.Typer) -> None:
    app.command()(up)
    app.command()(down)
    app.command()(status)
