"""``chatpipe cluster up | down | status | node stop|kill|start|restart ID``: a multi-node Kafka cluster.

Three KRaft nodes on loopback by default (``infra.kafka_cluster``), each a broker and a quorum
voter. ``up`` also applies the topic catalog, replicated 3 ways with ``min.insync.replicas=2``.
``print_cluster_status`` is what ``chatpipe status`` prints for a stack of ``--brokers N``; the single
broker of ``chatpipe up`` is not here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from chatpipe.commands.common import build_settings, console, table
from chatpipe.options import option
from infra.cluster_settings import ClusterSettings  # pydantic only: the flags are made from its fields
from transport.settings import KafkaSettings

cluster_app = typer.Typer(help="A Kafka cluster of several KRaft nodes on this machine.", no_args_is_help=True)
node_app = typer.Typer(help="Stop, kill or restart one node by id.", no_args_is_help=True)

StateDir = Annotated[Optional[Path], option(ClusterSettings, "state_dir", help="State folder")]
Brokers = Annotated[Optional[int], option(ClusterSettings, "brokers", "--brokers", "-n")]
BasePort = Annotated[Optional[int], option(ClusterSettings, "cluster_base_port", "--base-port")]
Prefix = Annotated[Optional[str], option(KafkaSettings, "topic_prefix", help="Prefix of every catalog topic")]
NodeId = Annotated[int, typer.Argument(help="Node id (1..brokers)")]


def _settings(state_dir, brokers, base_port) -> ClusterSettings:
    return build_settings(ClusterSettings, state_dir=state_dir, brokers=brokers, cluster_base_port=base_port)


def _cluster(state_dir, brokers, base_port):
    from infra.kafka_cluster import KafkaCluster

    return KafkaCluster(_settings(state_dir, brokers, base_port))


def print_cluster_status(settings: "ClusterSettings") -> bool:
    """Print each node, the controller leader and every partition's leader and ISR; True if all nodes are live."""
    from infra.kafka_cluster import KafkaCluster

    st = KafkaCluster(settings).status()
    nodes = table("node", "state", "pid", "client port", "quorum port", "role", "folder",
                  title=f"Kafka {st.version} cluster ({st.bootstrap_servers})")
    for n in st.nodes:
        state = "live" if n.registered else ("starting / fenced" if n.running else "stopped")
        role = "controller leader" if n.node_id == st.controller_leader else "voter"
        nodes.add_row(str(n.node_id), state, str(n.pid or "-"), str(n.client_port), str(n.controller_port),
                      role, str(n.dir))
    console.print(nodes)
    leader = st.controller_leader
    console.print(f"controller leader: node {leader}" if leader is not None else "controller leader: none (no quorum)")
    if st.partitions:
        partitions = table("topic", "partition", "leader", "replicas", "in-sync replicas", title="partitions")
        for p in st.partitions:
            short = set(p.isr) != set(p.replicas)
            isr = ",".join(map(str, p.isr)) + ("  (under-replicated)" if short else "")
            partitions.add_row(p.topic, str(p.partition), str(p.leader) if p.leader >= 0 else "none",
                          ",".join(map(str, p.replicas)), isr)
        console.print(partitions)
    return all(n.registered for n in st.nodes)


@cluster_app.command("up")
def up(state_dir: StateDir = None, brokers: Brokers = None, base_port: BasePort = None, topic_prefix: Prefix = None) -> None:
    """Start the cluster in the background, wait until every node is a live broker, apply the topic catalog."""
    from transport.admin import TopicAdmin

    cluster = _cluster(state_dir, brokers, base_port)
    settings = cluster.settings
    with console.status(f"starting {settings.brokers} Kafka nodes on {settings.bootstrap_servers}..."):
        started = cluster.up()
    state = "started" if started else "already running"
    console.print(f"Kafka cluster {state}: {settings.brokers} node(s), {settings.bootstrap_servers}, "
                  f"controller leader node {cluster.controller_leader()}, state {settings.cluster_dir}")
    # The catalog, replicated by the cluster's size.
    kafka = build_settings(KafkaSettings, bootstrap_servers=settings.bootstrap_servers, topic_prefix=topic_prefix)
    changes = TopicAdmin(kafka).apply()
    console.print(f"topic catalog applied: {len(changes)} change(s)")
    for change in changes:
        console.print(f"  {change.action:20} {change.topic}  {change.detail}")


@cluster_app.command("down")
def down(state_dir: StateDir = None, brokers: Brokers = None, base_port: BasePort = None) -> None:
    """Stop every node cleanly."""
    stopped = _cluster(state_dir, brokers, base_port).down()  # all at once, SIGTERM; SIGKILL after the timeout
    console.print(f"Kafka cluster stopped: node(s) {stopped}" if stopped else "Kafka cluster was not running")


@cluster_app.command("status")
def status(state_dir: StateDir = None, brokers: Brokers = None, base_port: BasePort = None) -> None:
    """Each node, the controller leader, every partition's leader and in-sync replicas (exit 1 if a node is not live)."""
    if not print_cluster_status(_settings(state_dir, brokers, base_port)):
        raise typer.Exit(code=1)


# `chatpipe cluster node <command> ID`: the KafkaCluster method it calls, what the node then is, what it
# says when there was nothing to do (the method returned False), and its help.
_NODE_COMMANDS = {
    "stop": ("stop_node", "stopped", "was not running",
             "Stop one node cleanly (SIGTERM: it hands its partition leaderships over first)."),
    "kill": ("kill_node", "killed", "was not running", "SIGKILL one node: a crash, nothing flushed or handed over."),
    "start": ("start_node", "started", "was already running",
              "Start one stopped or killed node and wait until it is a live broker again."),
    "restart": ("restart_node", "restarted", "",
                "Stop (SIGTERM) and start one node; waits until it is a live broker again."),
}


def _node_command(method: str, done: str, nothing_done: str, help_: str) -> Callable[..., None]:
    def command(node_id: NodeId, state_dir: StateDir = None, brokers: Brokers = None, base_port: BasePort = None) -> None:
        acted = getattr(_cluster(state_dir, brokers, base_port), method)(node_id)
        console.print(f"node {node_id} {nothing_done if acted is False else done}")

    command.__doc__ = help_
    return command


for _name, (_method, _done, _nothing_done, _help) in _NODE_COMMANDS.items():
    node_app.command(_name)(_node_command(_method, _done, _nothing_done, _help))


def register(app: typer.Typer) -> None:
    cluster_app.add_typer(node_app, name="node")
    app.add_typer(cluster_app, name="cluster")
