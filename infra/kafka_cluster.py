"""A real Kafka cluster on one machine: N combined broker + controller KRaft nodes on loopback.

Every node is its own JVM (``kafka.Kafka`` from the jars ``infra.local_kafka`` fetches), with its
own ports, data and log folder under ``<state>/cluster/node-<id>``; all of them are voters of
one controller quorum (a static ``controller.quorum.voters``), so any minority can die. Node
control (stop, SIGKILL, restart by id) is here for operators and the durability tests.

Inspection answers what a failure test needs: which nodes run, which node leads the controller
quorum (read from each node's ``quorum-state`` file: Kafka's metadata answer to clients names a
random broker as "controller" in KRaft), and every partition's leader and in-sync replicas.

Not here: topics and their replication (``transport.admin``), the single broker of ``chatpipe up``
(``infra.local_kafka``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from infra.cluster_settings import ClusterSettings
from infra.local_kafka import (BrokerStartError, PortInUseError, StackError, ensure_jars, kafka_java, kafka_version,
                               new_cluster_id, plaintext_listeners, port_open, server_properties)
from infra.services import alive, command_line, pid_in, spawn, tail


def _process_alive(pid: int) -> bool:
    """True while any thread of process ``pid`` runs. A JVM's main thread can exit first: the
    process then shows as a zombie while its other threads still shut down (and hold its ports)."""
    try:
        return alive(pid) or len(os.listdir(f"/proc/{pid}/task")) > 1
    except OSError:
        return False


class ClusterError(StackError):
    """The cluster cannot do what was asked (unknown node, no quorum in time, ...)."""


@dataclass(frozen=True, slots=True)
class NodeStatus:
    node_id: int
    running: bool  # the JVM is alive (it may still be starting)
    registered: bool  # the cluster's metadata lists it as a live broker
    pid: int | None
    client_port: int
    controller_port: int
    dir: Path


@dataclass(frozen=True, slots=True)
class PartitionState:
    topic: str
    partition: int
    leader: int  # -1: no leader (every in-sync replica is down)
    replicas: tuple[int, ...]
    isr: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    version: str
    bootstrap_servers: str
    nodes: list[NodeStatus]
    controller_leader: int | None  # None while an election runs or no node is up
    partitions: list[PartitionState]  # empty when no broker answers


class ClusterNode:
    """Files, config and process of one node."""

    def __init__(self, settings: ClusterSettings, node_id: int) -> None:
        self.settings = settings
        self.node_id = node_id
        self.dir = settings.cluster_dir / f"node-{node_id}"
        self.data_dir = self.dir / "data"
        self.logs_dir = self.dir / "logs"
        self.pid_file = self.dir / "node.pid"
        self.props = self.dir / "server.properties"
        self.stdout_file = self.logs_dir / "node.out"
        self.client_port = settings.client_port(node_id)
        self.controller_port = settings.controller_port(node_id)
        self.proc: subprocess.Popen | None = None  # set when this object started the JVM

    def pid(self) -> int | None:
        """Pid of this node's JVM if it is alive (and really is this node: pids get recycled)."""
        if self.proc is not None and self.proc.poll() is None:
            # Our own child: ask it. Its /proc cmdline is briefly not java's while it starts.
            return self.proc.pid
        # Not started here, or our child has exited and another process (the CLI) may have
        # started the node again: the pid file names the JVM.
        pid = pid_in(self.pid_file)
        if pid is None or (self.proc is not None and pid == self.proc.pid):
            return None
        cmdline = command_line(pid)
        return pid if "kafka.Kafka" in cmdline and str(self.props) in cmdline and _process_alive(pid) else None

    def write_config(self) -> None:
        s = self.settings
        voters = ",".join(f"{i}@{s.host}:{s.controller_port(i)}" for i in s.node_ids)
        rf, min_isr = min(3, s.brokers), min(2, s.brokers)
        # Internal topics replicated like the catalog's (3 copies, 2 must have a write).
        self.props.write_text(server_properties(
            "# Written on every start by infra/kafka_cluster.py; edit ClusterSettings, not this file.", self.node_id,
            voters, plaintext_listeners(s.host, self.client_port, self.controller_port), self.data_dir, rf, min_isr,
            f"default.replication.factor={rf}",
            f"min.insync.replicas={min_isr}",
            # A leader that was not in sync would lose acknowledged writes: never elect one.
            "unclean.leader.election.enable=false",
            f"broker.session.timeout.ms={s.broker_session_timeout_ms}",
            f"broker.heartbeat.interval.ms={s.broker_heartbeat_interval_ms}",
            f"replica.lag.time.max.ms={s.replica_lag_time_max_ms}",
            # A restarted node takes its preferred leaderships back soon, not after 5 minutes.
            "leader.imbalance.check.interval.seconds=20",
            # Three JVMs share a small machine: few threads each.
            "num.network.threads=2",
            "num.io.threads=2",
            "background.threads=2",
            "num.replica.fetchers=1"))

    def format(self, lib: Path, cluster_id: str) -> subprocess.Popen:
        """Start formatting this node's data folder (the caller waits: nodes format in parallel)."""
        return subprocess.Popen(
            [*kafka_java(self.settings.java, lib, self.logs_dir, "-Xmx128m"), "kafka.tools.StorageTool", "format",
             f"--cluster-id={cluster_id}", f"--config={self.props}"],  # "--x=v": the id may start with "-"
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def check_ports(self) -> None:
        for port in (self.client_port, self.controller_port):
            if port_open(self.settings.host, port):
                raise PortInUseError(
                    f"port {port} on {self.settings.host} (node {self.node_id}) is already in use by another "
                    "program; choose other ports with --base-port (CHATPIPE_CLUSTER_BASE_PORT)")

    def start(self, lib: Path) -> None:
        """Start the JVM in the background (no waiting: a node alone cannot form the quorum)."""
        java = kafka_java(self.settings.java, lib, self.logs_dir, f"-Xmx{self.settings.node_heap}", "-Xms64m",
                          "-XX:+UseG1GC", "-Djava.awt.headless=true")
        # In a session of its own: it outlives the CLI; `down` stops it.
        self.proc = spawn([*java, "kafka.Kafka", str(self.props)], self.stdout_file, cwd=self.dir)
        self.pid_file.write_text(str(self.proc.pid))

    def signal(self, sig: signal.Signals, wait_s: float) -> bool:
        """Send ``sig`` and wait up to ``wait_s`` for the JVM to exit. False if it was not running."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and self.pid() is not None:
            time.sleep(0.1)
        return True

    def quorum_state(self) -> tuple[int, int] | None:
        """(leader epoch, leader id or -1) this node last recorded for the controller quorum."""
        path = self.data_dir / "__cluster_metadata-0" / "quorum-state"
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            return None  # not written yet, or caught mid-write
        return int(state.get("leaderEpoch", -1)), int(state.get("leaderId", -1))

    def log_tail(self) -> str:
        return f"{tail(self.stdout_file, 10)}\n{tail(self.logs_dir / 'server.log', 30)}"


class KafkaCluster:
    """Start, stop, break and inspect the nodes of one state folder's cluster."""

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self.nodes = {n: ClusterNode(settings, n) for n in settings.node_ids}
        self.cluster_id_file = settings.cluster_dir / "cluster.id"

    @property
    def bootstrap_servers(self) -> str:
        return self.settings.bootstrap_servers

    def node(self, node_id: int) -> ClusterNode:
        try:
            return self.nodes[node_id]
        except KeyError:
            raise ClusterError(f"no node {node_id}: this cluster has nodes {sorted(self.nodes)}") from None

    # --- start -----------------------------------------------------------------------------
    def up(self) -> list[int]:
        """Start every node that is not running and wait until all are live brokers.

        Returns the ids started (empty when the whole cluster was already up).
        """
        down = [n for n, node in self.nodes.items() if node.pid() is None]
        if down:
            self._start(down)
        self.wait_registered(list(self.nodes))
        return down

    def start_node(self, node_id: int, *, wait: bool = True) -> bool:
        """Start one node (after stop or kill); False if it was running. Waits until it is a live broker."""
        node = self.node(node_id)
        if node.pid() is not None:
            return False
        self._start([node_id])
        if wait:
            self.wait_registered([node_id])
        return True

    def _start(self, node_ids: list[int]) -> None:
        lib = ensure_jars(self.settings)  # reads only cache_dir and mvn
        self.settings.cluster_dir.mkdir(parents=True, exist_ok=True)
        if not self.cluster_id_file.exists():
            self.cluster_id_file.write_text(new_cluster_id())
        cluster_id = self.cluster_id_file.read_text().strip()
        nodes = [self.nodes[n] for n in node_ids]
        for node in nodes:  # all before any starts: no half-started cluster on a taken port
            node.check_ports()
        formats = []
        for node in nodes:
            node.logs_dir.mkdir(parents=True, exist_ok=True)
            node.write_config()
            if not (node.data_dir / "meta.properties").exists():
                formats.append((node, node.format(lib, cluster_id)))
        for node, proc in formats:
            output, _ = proc.communicate()
            if proc.returncode != 0:
                raise BrokerStartError(f"formatting {node.data_dir} failed:\n{output}")
        for node in nodes:
            node.start(lib)

    def wait_registered(self, node_ids: list[int]) -> None:
        """Wait until every node in ``node_ids`` is a live (unfenced) broker of the cluster."""
        deadline = time.monotonic() + self.settings.start_timeout_s
        want = set(node_ids)
        while True:
            dead = [n for n in node_ids if self.nodes[n].pid() is None]
            if dead:
                node = self.nodes[dead[0]]
                raise BrokerStartError(f"node {node.node_id} exited while starting. Its log:\n{node.log_tail()}")
            if want <= self.live_brokers():
                return
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- node {n}:\n{self.nodes[n].log_tail()}" for n in node_ids)
                raise BrokerStartError(f"nodes {sorted(want - self.live_brokers())} did not join the cluster "
                                       f"within {self.settings.start_timeout_s:.0f}s.\n{tails}")
            time.sleep(0.3)

    # --- stop / break ----------------------------------------------------------------------
    def stop_node(self, node_id: int) -> bool:
        """Stop one node cleanly (SIGTERM: it hands its leaderships over first); SIGKILL after the timeout."""
        node = self.node(node_id)
        if not node.signal(signal.SIGTERM, self.settings.stop_timeout_s):
            return False
        node.signal(signal.SIGKILL, 10.0)  # no-op when it exited in time
        node.pid_file.unlink(missing_ok=True)
        return True

    def kill_node(self, node_id: int) -> bool:
        """SIGKILL one node: no flush, no handing over; the crash the durability tests need."""
        node = self.node(node_id)
        stopped = node.signal(signal.SIGKILL, 10.0)
        node.pid_file.unlink(missing_ok=True)
        return stopped

    def restart_node(self, node_id: int) -> None:
        """Stop (SIGTERM) one node if it runs, start it again, wait until it is a live broker."""
        self.stop_node(node_id)
        self.start_node(node_id)

    def down(self) -> list[int]:
        """Stop every node. All get SIGTERM at once so the quorum stays up while they hand over."""
        running = [n for n, node in self.nodes.items() if node.pid() is not None]
        for n in running:
            os.kill(self.nodes[n].pid(), signal.SIGTERM)
        deadline = time.monotonic() + self.settings.stop_timeout_s
        while time.monotonic() < deadline and any(self.nodes[n].pid() is not None for n in running):
            time.sleep(0.2)
        for n in running:
            self.nodes[n].signal(signal.SIGKILL, 10.0)  # no-op for a node that exited in time
            self.nodes[n].pid_file.unlink(missing_ok=True)
        return running

    # --- inspection ------------------------------------------------------------------------
    def controller_leader(self) -> int | None:
        """The active controller: the leader of the newest epoch any running node recorded."""
        states = [s for node in self.nodes.values() if node.pid() is not None
                  if (s := node.quorum_state()) is not None]
        epoch, leader = max(states, default=(-1, -1))
        return leader if leader >= 0 else None

    def _metadata(self, timeout_s: float = 3.0):
        from confluent_kafka import KafkaException
        from transport import clients as kafka_clients  # raw: the brokers this cluster starts itself

        admin = kafka_clients.raw_admin({"bootstrap.servers": self.bootstrap_servers, "log_level": 0,
                             "socket.connection.setup.timeout.ms": 1000})
        try:
            return admin.list_topics(timeout=timeout_s)
        except KafkaException:
            return None

    def live_brokers(self) -> set[int]:
        metadata = self._metadata()
        return set(metadata.brokers) if metadata is not None else set()

    def partitions(self, topics: list[str] | None = None) -> list[PartitionState]:
        """Leader, replicas and ISR of every partition of ``topics`` (all non-internal when None)."""
        metadata = self._metadata()
        if metadata is None:
            return []
        names = sorted(t for t in metadata.topics if not t.startswith("__")) if topics is None else topics
        states = []
        for name in names:
            topic = metadata.topics.get(name)
            if topic is not None and topic.error is None:
                states += [PartitionState(name, pid, p.leader, tuple(p.replicas), tuple(p.isrs))
                           for pid, p in sorted(topic.partitions.items())]
        return states

    def status(self) -> ClusterStatus:
        # No JVM of ours runs: skip the metadata request (it would wait its full timeout).
        live = self.live_brokers() if any(node.pid() is not None for node in self.nodes.values()) else set()
        nodes = [NodeStatus(n, (pid := node.pid()) is not None, n in live, pid, node.client_port,
                            node.controller_port, node.dir) for n, node in self.nodes.items()]
        return ClusterStatus(kafka_version(), self.bootstrap_servers, nodes, self.controller_leader(),
                             self.partitions() if live else [])
