"""Settings of a multi-node Kafka cluster on one machine (``chatpipe cluster``, ``chatpipe up --brokers 3``).

Kept apart from ``StackSettings`` (the single broker and the services around it): the cluster
has per-node ports and its own failure-detection timeouts. Not here: topic replication, which
``transport.admin`` decides from the cluster's size when it applies the catalog.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from infra.settings import default_cache_dir


class ClusterSettings(BaseSettings):
    """A Kafka cluster of several KRaft nodes on one machine (``chatpipe cluster``, ``up --brokers 3``).

    Every node is a combined broker + controller; together they form the controller quorum.
    Node ``n`` (1-based) listens on ``cluster_base_port + 2(n-1)`` for clients and the next port
    for the quorum, unless ``client_ports`` / ``controller_ports`` name every port (tests take
    free ones). From CLI flags and ``CHATPIPE_*`` variables (``CHATPIPE_CLUSTER_BROKERS``, ...).
    """

    model_config = SettingsConfigDict(env_prefix="CHATPIPE_", frozen=True, extra="ignore", populate_by_name=True)

    state_dir: Path = Field(Path(".chatpipe"), description="Each node's data and logs go under <state>/cluster/node-<id>")
    cache_dir: Path = Field(default_factory=default_cache_dir,
                            description="Kafka jars assembled by mvn, shared by every state folder")
    host: str = Field("127.0.0.1", description="Address every node listens on (loopback only by default)")
    # CHATPIPE_CLUSTER_BROKERS, not CHATPIPE_BROKERS: that one is the stack's (`up`, default 1 = one broker);
    # `up --brokers 3` passes its count here by name.
    brokers: int = Field(3, ge=1, le=9, validation_alias=AliasChoices("CHATPIPE_CLUSTER_BROKERS"),
                         description="Number of nodes (each a broker and a quorum voter)")
    cluster_base_port: int = Field(9192, ge=1, le=65000, description="Client port of node 1; node n takes base + 2(n-1) and the next")
    client_ports: tuple[int, ...] = Field((), description="Explicit client port of every node (overrides the base port)")
    controller_ports: tuple[int, ...] = Field((), description="Explicit quorum port of every node (overrides the base port)")
    node_heap: str = Field("320m", description="JVM heap (-Xmx) of each node")
    # Failure detection tuned for loopback: a dead node is fenced after broker_session_timeout_ms
    # (Kafka's 9 s default) and a silent follower leaves the ISR after replica_lag_time_max_ms
    # (30 s). Shorter values shorten every produce stall; too short flaps on a loaded machine.
    broker_session_timeout_ms: int = Field(4000, ge=500, description="Controller fences a node missing heartbeats this long")
    broker_heartbeat_interval_ms: int = Field(1000, ge=100, description="Node heartbeat to the active controller")
    replica_lag_time_max_ms: int = Field(8000, ge=500, description="A follower this far behind leaves the ISR")
    java: str = Field("java", description="Java 17+ executable")
    mvn: str = Field("mvn", description="Maven executable used once to fetch the broker jars")
    start_timeout_s: float = Field(120.0, gt=0, description="How long starting Kafka waits for the broker (every "
                                   "node of a cluster) to answer")
    stop_timeout_s: float = Field(30.0, gt=0, description="How long a stop waits after SIGTERM before SIGKILL")

    @model_validator(mode="after")
    def _ports_complete(self) -> "ClusterSettings":
        for name in ("client_ports", "controller_ports"):
            ports = getattr(self, name)
            if ports and len(ports) != self.brokers:
                raise ValueError(f"{name} names {len(ports)} port(s) for {self.brokers} broker(s)")
        return self

    def client_port(self, node_id: int) -> int:
        return self.client_ports[node_id - 1] if self.client_ports else self.cluster_base_port + 2 * (node_id - 1)

    def controller_port(self, node_id: int) -> int:
        return self.controller_ports[node_id - 1] if self.controller_ports else self.cluster_base_port + 2 * node_id - 1

    @property
    def node_ids(self) -> range:
        return range(1, self.brokers + 1)

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(f"{self.host}:{self.client_port(n)}" for n in self.node_ids)

    @property
    def cluster_dir(self) -> Path:
        return self.state_dir.resolve() / "cluster"
