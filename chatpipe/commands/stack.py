"""``chatpipe up | down | status``: the local stack (Kafka, streams, inference worker, gateway).

The work is in ``infra.stack``; this module turns flags into ``StackSettings`` and prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from chatpipe.commands.common import build_settings, console

StateDir = Annotated[Optional[Path], typer.Option("--state-dir", help="State folder [env CHATPIPE_STATE_DIR; default .chatpipe]")]
KafkaPort = Annotated[Optional[int], typer.Option("--kafka-port", help="Broker client port [env CHATPIPE_KAFKA_PORT; default 9092]")]
ControllerPort = Annotated[Optional[int], typer.Option("--controller-port", help="KRaft controller port [env CHATPIPE_CONTROLLER_PORT; default 9093]")]
GatewayPort = Annotated[Optional[int], typer.Option("--gateway-port", help="Gateway HTTP port [env CHATPIPE_GATEWAY_PORT; default 8000]")]
MetricsPort = Annotated[Optional[int], typer.Option("--worker-metrics-port", help="Inference worker /metrics port [env CHATPIPE_WORKER_METRICS_PORT; default 9464]")]
Brokers = Annotated[Optional[int], typer.Option("--brokers", help="Kafka nodes: 1 = one broker; 3 = a KRaft cluster (nodes on CHATPIPE_CLUSTER_BASE_PORT, default 9192-9197; catalog replicated 3 ways, min.insync.replicas 2) [env CHATPIPE_BROKERS; default 1]")]
Only = Annotated[Optional[str], typer.Option("--only", help="Start only these, comma-separated: kafka (broker + topics), streams, inference, gateway; Kafka always [default: all]")]


def _open(state_dir, kafka_port=None, controller_port=None, gateway_port=None, worker_metrics_port=None,
          brokers=None):
    from infra.settings import StackSettings
    from infra.stack import LocalStack

    settings = build_settings(StackSettings, state_dir=state_dir, kafka_port=kafka_port,
                              controller_port=controller_port, gateway_port=gateway_port,
                              worker_metrics_port=worker_metrics_port, brokers=brokers)
    return LocalStack.open(settings)


def _parse_only(only: str | None) -> list[str] | None:
    from infra.stack import ALL, StackError

    if only is None:
        return None
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL]
    if unknown:
        raise StackError(f"--only: no service {', '.join(unknown)}; choose from {', '.join(ALL)}")
    return names


def up(state_dir: StateDir = None, kafka_port: KafkaPort = None, controller_port: ControllerPort = None,
       gateway_port: GatewayPort = None, worker_metrics_port: MetricsPort = None, only: Only = None,
       brokers: Brokers = None) -> None:
    """Start the stack in the background (what is not running yet) and wait until each service is healthy."""
    import time

    wanted = _parse_only(only)
    stack = _open(state_dir, kafka_port, controller_port, gateway_port, worker_metrics_port, brokers)
    s = stack.settings
    began = time.monotonic()
    with console.status(f"starting Kafka on {stack.bootstrap_servers} (first run fetches jars with mvn)...") as spinner:

        def on_ready(health, started, seconds):
            verb = "started" if started else "already running"
            console.print(f"[green]✓[/] {health.name:9} {verb}: pid {health.pid}, {health.address}  "
                          f"[dim]({seconds:.1f} s, log {health.log})[/]")

        def on_topics(changes):
            console.print(f"  topic catalog applied: {len(changes)} change(s)")
            for change in changes:
                console.print(f"    {change.action:15} {change.topic}  {change.detail}")

        def on_wait(pending, seconds):
            waiting = ", ".join(f"{name} ({why})" for name, why in pending.items())
            spinner.update(f"waiting for {waiting} ... {seconds:.0f} s")

        try:
            stack.up(wanted, on_ready=on_ready, on_topics=on_topics, on_wait=on_wait)
        except KeyboardInterrupt:
            # The services run in their own sessions: Ctrl-C stopped the waiting, not them.
            console.print("interrupted: what was started keeps running; `chatpipe status` / `chatpipe down`")
            raise typer.Exit(code=130) from None
    if "gateway" in stack.services:
        from infra.local_keys import first_key

        console.print(f"gateway: {s.gateway_url}/v1  API key {first_key(s.keys_file)}  (in {s.keys_file})")
    console.print(f"stack up in {time.monotonic() - began:.1f} s; `chatpipe status` shows it, `chatpipe down` stops it")


def down(state_dir: StateDir = None, kafka_port: KafkaPort = None, controller_port: ControllerPort = None,
         gateway_port: GatewayPort = None, worker_metrics_port: MetricsPort = None, brokers: Brokers = None) -> None:
    """Stop gateway, inference, streams, then Kafka (SIGTERM; SIGKILL only after the stop timeout)."""
    stack = _open(state_dir, kafka_port, controller_port, gateway_port, worker_metrics_port, brokers)

    def on_stopped(result):
        if result.outcome == "not running":
            console.print(f"{result.name:9} was not running")
        else:
            how = "stopped (SIGTERM)" if result.outcome == "stopped" else "[red]killed (SIGKILL after SIGTERM timeout)[/]"
            console.print(f"{result.name:9} {how}: pid {result.pid}, {result.seconds:.1f} s")

    stack.down(on_stopped)


def status(state_dir: StateDir = None, kafka_port: KafkaPort = None, controller_port: ControllerPort = None,
           gateway_port: GatewayPort = None, worker_metrics_port: MetricsPort = None, brokers: Brokers = None) -> None:
    """Each service's health, pid, address and log; on a cluster each node, the controller leader and every
    partition's leader and in-sync replicas; consumer groups with their lag; topics. Exit 1 if one is down."""
    from transport.errors import TransportError

    stack = _open(state_dir, kafka_port, controller_port, gateway_port, worker_metrics_port, brokers)
    healths = stack.status()
    table = Table(title=f"chatpipe local stack ({stack.settings.state_dir})")
    for col in ("service", "health", "pid", "address", "log"):
        table.add_column(col, overflow="fold")  # a path cut with "…" cannot be copied
    colour = {"healthy": "green", "not started": "dim"}
    for h in healths:
        state = h.state + (f": {h.detail}" if h.detail else "")
        table.add_row(h.name, f"[{colour.get(h.state, 'red')}]{state}[/]", str(h.pid or "-"), h.address, str(h.log))
    console.print(table)
    down = [h.name for h in healths if not h.healthy and h.state != "not started"]
    if stack.settings.brokers > 1:
        from chatpipe.commands.cluster import print_cluster_status
        from infra.cluster_broker import cluster_settings

        print_cluster_status(cluster_settings(stack.settings))
    if healths[0].healthy:
        admin = stack.admin()
        try:
            groups, topics = admin.group_lags(), admin.describe()
        except TransportError as exc:
            console.print(f"[red]cannot read groups and topics:[/] {exc}")
            raise typer.Exit(code=1) from None
        lag_table = Table(title="consumer groups")
        for col in ("group", "type", "state", "members", "lag"):
            lag_table.add_column(col)
        for g in groups:
            lag_table.add_row(g.group, g.kind, g.state, "-" if g.members is None else str(g.members),
                              "-" if g.lag is None else str(g.lag))
        console.print(lag_table)
        topic_table = Table(title="topics")
        for col in ("topic", "partitions", "end offsets", "messages"):
            topic_table.add_column(col)
        for info in topics:
            topic_table.add_row(info.name, str(info.partitions), " ".join(map(str, info.end_offsets)), str(info.messages))
        console.print(topic_table)
    if down:
        console.print(f"[red]down:[/] {', '.join(down)}")
        raise typer.Exit(code=1)


def register(app: typer.Typer) -> None:
    app.command()(up)
    app.command()(down)
    app.command()(status)
