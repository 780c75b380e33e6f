"""``chatpipe up | down | status | restart | stop``: the local stack (Kafka, streams, inference worker,
gateway), and ``chatpipe supervise``, the supervisor ``up`` starts in the background.

The work is in ``infra.stack`` and ``infra.supervisor``; this module turns flags into ``StackSettings``
and prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from chatpipe.commands.common import build_settings, console, table
from chatpipe.options import option
from infra.settings import StackSettings  # pydantic only: the flags are made from its fields

StateDir = Annotated[Optional[Path], option(StackSettings, "state_dir", "--state-dir", help="State folder")]
KafkaPort = Annotated[Optional[int], option(StackSettings, "kafka_port", "--kafka-port", help="Broker client port")]
ControllerPort = Annotated[Optional[int], option(StackSettings, "controller_port", "--controller-port")]
GatewayPort = Annotated[Optional[int], option(StackSettings, "gateway_port", "--gateway-port", help="Gateway HTTP port")]
MetricsPort = Annotated[Optional[int], option(StackSettings, "worker_metrics_port", "--worker-metrics-port",
                                              help="Inference worker /metrics port")]
StreamsMetricsPort = Annotated[Optional[int], option(StackSettings, "streams_metrics_port", "--streams-metrics-port",
                                                     help="Streams worker /metrics port; worker n's on it + n - 1")]
Brokers = Annotated[Optional[int], option(StackSettings, "brokers", "--brokers", help=(
    "Kafka nodes: 1 = one broker; 3 = a KRaft cluster (nodes on CHATPIPE_CLUSTER_BASE_PORT, default 9192-9197; "
    "catalog replicated 3 ways, min.insync.replicas 2)"))]
QdrantUrl = Annotated[Optional[str], option(StackSettings, "qdrant_url", "--qdrant-url", help=(
    "Qdrant server URL(s) for the streams worker's memory, instead of local mode in <state>/qdrant (the default); "
    "kept with the state folder, '' goes back to local mode"))]
StreamsWorkers = Annotated[Optional[int], option(StackSettings, "streams_workers", "--streams-workers", help=(
    "Streams worker processes (streams, streams-2, ...), one consumer group; more than 1 needs --qdrant-url; kept "
    "with the state folder, a smaller number stops the surplus"))]
InferenceWorkers = Annotated[Optional[int], option(StackSettings, "inference_workers", "--inference-workers", help=(
    "Inference worker processes (inference, inference-2, ...), one consumer group; worker n's /metrics on "
    "--worker-metrics-port + n - 1; kept with the state folder"))]
Names = Annotated[list[str], typer.Argument(help="Services: kafka, redis, streams, streams-2, ..., inference, inference-2, ..., gateway", show_default=False)]
KafkaSecurity = Annotated[Optional[str], option(StackSettings, "kafka_security", "--kafka-security", help=(
    "The broker's client listener: plaintext, or sasl_ssl (SCRAM-SHA-512 over TLS: a CA, the broker's certificate "
    "and one user per service made under <state>/kafka/security; every service gets its own login; "
    "docs/security_broker.md); kept with the state folder"))]
Only = Annotated[Optional[str], typer.Option("--only", help="Start only these, comma-separated: kafka (broker + topics), redis (the response cache; with streams too), streams, inference, gateway (jaeger, prometheus with --observability); Kafka always [default: all]")]
Observability = Annotated[Optional[bool], option(StackSettings, "observability", "--observability/--no-observability", help=(
    "Also run Jaeger (traces, UI on :16686, OTLP on :4317/:4318) and Prometheus (scrapes every service, :9090), "
    "built once with Go and npm into ~/.cache/chatpipe/bin (docs/observability.md); kept with the state folder, "
    "--no-observability stops them"))]
ResponseCache = Annotated[Optional[bool], option(StackSettings, "response_cache", "--response-cache/--no-response-cache", help=(
    "Run Redis (redis-server, maxmemory with allkeys-lru, no persistence) as the streams workers' response cache "
    "and give each streams worker its URL; kept with the state folder, --no-response-cache runs the stack without "
    "Redis and without a cache (docs/stack.md)"))]
RedisPort = Annotated[Optional[int], option(StackSettings, "redis_port", "--redis-port",
                                            help="Redis port (the response cache)")]
InferenceEngine = Annotated[Optional[str], option(StackSettings, "inference_engine", "--engine", help=(
    "The inference workers' engine: chatpipe (ours, the default on CPU), vllm (vLLM's engine in its own "
    "environment: make setup-vllm) or auto (vllm on a CUDA device when its environment is there); kept with the "
    "state folder"))]


def _open(**flags):
    """The stack of the state folder, its ``StackSettings`` from the flags given (``build_settings``)."""
    from infra.stack import LocalStack

    return LocalStack.open(build_settings(StackSettings, **flags))


def _parse_names(names: list[str], stack) -> list[str]:
    from infra.instances import parse_instance
    from infra.stack import StackError

    unknown = [n for n in names if n not in stack.names]
    if unknown or not names:
        beyond = [n for n in unknown if parse_instance(n) is not None]
        hint = (f" ({', '.join(beyond)}: more workers than the stack runs; `chatpipe up --streams-workers N` / "
                "`--inference-workers N` changes how many)" if beyond else "")
        raise StackError(f"no service {', '.join(unknown) or 'named'}; choose from {', '.join(stack.names)}{hint}")
    return [n for n in stack.names if n in names]  # in start order


def _parse_only(only: str | None) -> list[str] | None:
    from infra.stack import ALL, StackError

    if only is None:
        return None
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL]
    if unknown:
        raise StackError(f"--only: no service {', '.join(unknown)}; choose from {', '.join(ALL)}")
    return names


def _on_wait(spinner):
    """``on_wait`` of ``up`` and ``restart``: the spinner names each service not healthy yet, and why."""
    return lambda pending, seconds: spinner.update(
        f"waiting for {', '.join(f'{name} ({why})' for name, why in pending.items())} ... {seconds:.0f} s")


def _on_ready(health, started, seconds):
    verb = "started" if started else "already running"
    console.print(f"[green]✓[/] {health.name:9} {verb}: pid {health.pid}, {health.address}  "
                  f"[dim]({seconds:.1f} s, log {health.log})[/]")


def up(state_dir: StateDir = None, kafka_port: KafkaPort = None, controller_port: ControllerPort = None,
       gateway_port: GatewayPort = None, worker_metrics_port: MetricsPort = None, only: Only = None,
       brokers: Brokers = None, qdrant_url: QdrantUrl = None, streams_workers: StreamsWorkers = None,
       inference_workers: InferenceWorkers = None, kafka_security: KafkaSecurity = None,
       observability: Observability = None, streams_metrics_port: StreamsMetricsPort = None,
       response_cache: ResponseCache = None, redis_port: RedisPort = None, engine: InferenceEngine = None) -> None:
    """Start the stack in the background (what is not running yet) under its supervisor, which starts a
    service again when it exits; wait until each service is healthy. A worker count smaller than the
    running stack's stops the surplus workers; a larger one starts the extra ones."""
    import time

    wanted = _parse_only(only)
    stack = _open(state_dir=state_dir, kafka_port=kafka_port, controller_port=controller_port,
                  gateway_port=gateway_port, worker_metrics_port=worker_metrics_port, brokers=brokers,
                  qdrant_url=qdrant_url, streams_workers=streams_workers, inference_workers=inference_workers,
                  kafka_security=kafka_security, observability=observability,
                  streams_metrics_port=streams_metrics_port, response_cache=response_cache, redis_port=redis_port,
                  inference_engine=engine)
    s = stack.settings
    began = time.monotonic()
    with console.status(f"starting Kafka on {stack.bootstrap_servers} (first run fetches jars with mvn)...") as spinner:

        def on_topics(changes):
            # Creations as a count (their configs are the catalog's: `chatpipe topics list` shows them);
            # any other change, one line each, never wrapped into the next.
            created = sum(1 for change in changes if change.action == "create")
            console.print(f"  topic catalog applied: {len(changes)} change(s)"
                          + (f" ({created} topic(s) created; `chatpipe topics list` shows them)" if created else ""))
            for change in changes:
                if change.action != "create":
                    console.print(f"    {change.action:15} {change.topic}  {change.detail}", markup=False, soft_wrap=True)

        try:
            stack.up(wanted, on_ready=_on_ready, on_topics=on_topics, on_wait=_on_wait(spinner), on_stopped=_on_stopped,
                     on_build=lambda message: console.print(f"  {message}"))
        except KeyboardInterrupt:
            # The services run in their own sessions: Ctrl-C stopped the waiting, not them.
            console.print("interrupted: what was started keeps running; `chatpipe status` / `chatpipe down`")
            raise typer.Exit(code=130) from None
    if "gateway" in stack.services:
        from infra.local_keys import first_key

        console.print(f"gateway: {s.gateway_url}/v1  API key {first_key(s.keys_file)}  (in {s.keys_file})")
    if stack.broker_security is not None:
        from infra.kafka_security import ADMIN_USER

        console.print(f"Kafka is secured (SASL_SSL, SCRAM-SHA-512, one user per service); a shell's clients log in as "
                      f"{ADMIN_USER} after `set -a; . {stack.broker_security.env_file(ADMIN_USER)}; set +a`")
    if s.observability:
        console.print(f"traces: http://{s.host}:{s.jaeger_port} (Jaeger)  metrics: http://{s.host}:{s.prometheus_port} "
                      f"(Prometheus)  spans also in {s.state_dir.resolve() / 'traces'}")
    _print_supervisor(stack)
    console.print(f"stack up in {time.monotonic() - began:.1f} s; `chatpipe status` shows it, `chatpipe down` stops it")


def _print_supervisor(stack) -> None:
    pid, supervised, running = stack.supervisor.pid(), stack.supervised(), stack.running_services()
    unsupervised = [n for n in stack.names if n in running and not (n in supervised and supervised[n].wanted)]
    if stack.settings.brokers > 1 and "kafka" in unsupervised:
        unsupervised.remove("kafka")  # a cluster's nodes are never supervised (`chatpipe cluster node ...`)
    if pid is not None:
        console.print(f"supervisor: pid {pid}, starts a service again when it exits  [dim](log {stack.supervisor.log_file})[/]")
    elif (last := stack.supervisor.state()) is not None and last.phase not in ("idle", "released"):
        why = {"running": "it ended without stopping its services: killed?",
               "stopped": "SIGTERM stopped it and its services"}.get(last.phase, last.phase)
        console.print(f"[yellow]supervisor: not running[/] ({why}; see {stack.supervisor.log_file}); a service "
                      "that exits is not started again until `chatpipe up` starts the supervisor")
    if unsupervised and (pid is not None or stack.supervisor.state() is None):
        console.print(f"[yellow]not supervised:[/] {', '.join(unsupervised)} (started without the supervisor, e.g. by "
                      "an older chatpipe; `chatpipe down` then `chatpipe up` puts them under it)")


def _on_stopped(result):
    if result.outcome == "not running":
        console.print(f"{result.name:9} was not running")
    else:
        how = "stopped (SIGTERM)" if result.outcome == "stopped" else "[red]killed (SIGKILL after SIGTERM timeout)[/]"
        console.print(f"{result.name:9} {how}: pid {result.pid}, {result.seconds:.1f} s")


def down(state_dir: StateDir = None, kafka_port: KafkaPort = None, controller_port: ControllerPort = None,
         gateway_port: GatewayPort = None, worker_metrics_port: MetricsPort = None, brokers: Brokers = None) -> None:
    """Stop the supervisor (nothing is restarted), then gateway, inference, streams, Redis, then Kafka (SIGTERM;
    SIGKILL only after the stop timeout)."""
    stack = _open(state_dir=state_dir, kafka_port=kafka_port, controller_port=controller_port,
                  gateway_port=gateway_port, worker_metrics_port=worker_metrics_port, brokers=brokers)

    def on_released(pid):
        console.print(f"supervisor stopped: pid {pid} (services are no longer restarted)" if pid
                      else "supervisor was not running")

    stack.down(_on_stopped, on_released)


def restart(names: Names, state_dir: StateDir = None) -> None:
    """Stop (SIGTERM) and start again the named services through the supervisor, and wait until each is
    healthy; a service stopped by `chatpipe stop` is started. Not counted as a restart, no backoff."""
    stack = _open(state_dir=state_dir)
    wanted = _parse_names(names, stack)
    with console.status(f"restarting {', '.join(wanted)} ...") as spinner:
        stack.restart(wanted, on_ready=lambda h, started, s: _on_ready(h, True, s), on_wait=_on_wait(spinner))


def stop(names: Names, state_dir: StateDir = None) -> None:
    """Stop the named services through the supervisor and keep them stopped (SIGTERM; SIGKILL after the
    stop timeout) while the rest runs on; `chatpipe restart NAME` or `chatpipe up` starts one again."""
    stack = _open(state_dir=state_dir)
    stack.stop(_parse_names(names, stack), _on_stopped)


def supervise(state_dir: StateDir = None) -> None:
    """Run the stack's supervisor in the foreground (`chatpipe up` starts it in the background): start and
    restart the services of <state>/run/supervisor-spec.json until SIGTERM (stops them all) or SIGUSR1
    (leaves them running)."""
    from infra.supervisor import main

    raise typer.Exit(code=main(build_settings(StackSettings, state_dir=state_dir)))


AsJson = Annotated[bool, typer.Option("--json", help="One JSON object on stdout instead of tables: supervisor, services (health, pid, restarts, last exit with its log lines), groups, topics")]


def _status_json(stack, healths) -> dict:
    from dataclasses import asdict

    from transport.errors import TransportError

    state = stack.supervisor.state()
    data = {"state_dir": str(stack.settings.state_dir),
            "supervisor": {"pid": stack.supervisor.pid(), "phase": state.phase if state else None,
                           "log": str(stack.supervisor.log_file)},
            "services": [{**asdict(h), "log": str(h.log)} for h in healths],  # last_exit: a dict too, or None
            "groups": [], "topics": []}
    if healths[0].healthy:
        try:
            data["groups"] = [asdict(g) for g in stack.admin().group_lags()]
            data["topics"] = [{**asdict(t), "messages": t.messages} for t in stack.admin().describe()]
        except TransportError as exc:
            data["error"] = str(exc)
    return data


def status(state_dir: StateDir = None, kafka_port: KafkaPort = None, controller_port: ControllerPort = None,
           gateway_port: GatewayPort = None, worker_metrics_port: MetricsPort = None, brokers: Brokers = None,
           as_json: AsJson = False) -> None:
    """Each service's health, pid, restarts, last exit, address and log; on a cluster each node, the controller
    leader and every partition's leader and in-sync replicas; consumer groups with their lag; topics. Exit 1
    if one is down."""
    import json

    from transport.errors import TransportError

    stack = _open(state_dir=state_dir, kafka_port=kafka_port, controller_port=controller_port,
                  gateway_port=gateway_port, worker_metrics_port=worker_metrics_port, brokers=brokers)
    healths = stack.status()
    down = [h.name for h in healths if not h.healthy and h.state != "not started"]
    if as_json:
        data = _status_json(stack, healths)
        typer.echo(json.dumps(data, indent=1))
        if down or "error" in data:
            raise typer.Exit(code=1)
        return
    services = table("service", "health", "pid", "restarts", "last exit", "address", "log",
                     title=f"chatpipe local stack ({stack.settings.state_dir})",
                     overflow="fold")  # a path cut with "…" cannot be copied
    colour = {"healthy": "green", "not started": "dim"}
    for h in healths:
        state = h.state + (f": {h.detail}" if h.detail else "")
        restarts = "-" if h.restarts is None else str(h.restarts)
        services.add_row(h.name, f"[{colour.get(h.state, 'red')}]{state}[/]", str(h.pid or "-"), restarts,
                      _last_exit(h.last_exit), h.address, str(h.log))
    console.print(services)
    _print_supervisor(stack)
    for h in healths:  # a service that is down now: why it went, from the end of its log
        if not h.healthy and h.last_exit is not None and not h.last_exit.requested and h.last_exit.log_tail:
            console.print(f"[dim]{h.name}: last lines of its log at that exit:[/]")
            console.print("\n".join(f"  {line}" for line in h.last_exit.log_tail[-8:]), markup=False, highlight=False)
    if stack.settings.brokers > 1:
        from chatpipe.commands.cluster import print_cluster_status
        from infra.cluster_broker import cluster_settings

        print_cluster_status(cluster_settings(stack.settings))
    if healths[0].healthy:
        from chatpipe.commands.topics import topics_table

        admin = stack.admin()
        try:
            groups, topics = admin.group_lags(), admin.describe()
        except TransportError as exc:
            console.print(f"[red]cannot read groups and topics:[/] {exc}")
            raise typer.Exit(code=1) from None
        lag_table = table("group", "type", "state", "members", "lag", title="consumer groups")
        for g in groups:
            lag_table.add_row(g.group, g.kind, g.state, "-" if g.members is None else str(g.members),
                              "-" if g.lag is None else str(g.lag))
        console.print(lag_table)
        console.print(topics_table(topics, title="topics"))
    if down:
        console.print(f"[red]down:[/] {', '.join(down)}")
        raise typer.Exit(code=1)


def _last_exit(exit_) -> str:
    """"killed by SIGKILL, 12 s ago (ran 40 s)"; "-" when it never exited."""
    import time

    if exit_ is None:
        return "-"
    ago = time.time() - exit_.at
    when = f"{ago:.0f} s" if ago < 120 else f"{ago / 60:.0f} min" if ago < 7200 else f"{ago / 3600:.0f} h"
    asked = ", on request" if exit_.requested else ""
    return f"{exit_.reason}{asked}, {when} ago (ran {exit_.ran_s:.0f} s)"


def register(app: typer.Typer) -> None:
    for command in (up, down, status, restart, stop):
        app.command()(command)
    app.command(hidden=True)(supervise)
