"""The Kafka of a stack started with ``chatpipe up --brokers N`` (N > 1): a KRaft cluster.

``infra.stack.LocalStack`` drives its broker through a small interface (``up``, ``down``,
``killed``, ``pid``, ``running``, ``answers``, ``logs_dir``, ``bootstrap_servers``) that
``LocalKafka`` has; this adapter gives ``KafkaCluster`` the same, so the services, health checks
and ``down`` work unchanged on a cluster. The nodes take the cluster's own ports
(``ClusterSettings``: node n on ``CHATPIPE_CLUSTER_BASE_PORT`` + 2(n-1), default 9192, and the next
port for its quorum), the same ones ``chatpipe cluster node kill|restart ID`` uses on that state
folder; ``--kafka-port`` is the single broker's.
"""

from __future__ import annotations

from pathlib import Path

from infra.cluster_settings import ClusterSettings
from infra.kafka_cluster import KafkaCluster
from infra.settings import StackSettings


def cluster_settings(settings: StackSettings) -> ClusterSettings:
    # Ports, heap and failure-detection timings from ClusterSettings' own CHATPIPE_* variables.
    return ClusterSettings(state_dir=settings.state_dir, cache_dir=settings.cache_dir, host=settings.host,
                           brokers=settings.brokers, java=settings.java, mvn=settings.mvn,
                           stop_timeout_s=settings.stop_timeout_s)


class ClusterBroker:
    def __init__(self, settings: StackSettings) -> None:
        self.cluster = KafkaCluster(cluster_settings(settings))
        self.killed = False
        self.logs_dir: Path = self.cluster.node(1).logs_dir

    @property
    def bootstrap_servers(self) -> str:
        return self.cluster.bootstrap_servers

    def pids(self) -> list[int]:
        return [pid for node in self.cluster.nodes.values() if (pid := node.pid()) is not None]

    def pid(self) -> int | None:
        pids = self.pids()
        return pids[0] if pids else None

    def running(self) -> bool:
        """Every node runs."""
        return len(self.pids()) == len(self.cluster.nodes)

    def answers(self) -> bool:
        return len(self.cluster.live_brokers()) == len(self.cluster.nodes)

    def up(self) -> bool:
        return bool(self.cluster.up())

    def down(self) -> bool:
        running = self.pids()
        stopped = self.cluster.down()
        self.killed = False  # KafkaCluster.down escalates to SIGKILL itself and does not say; nodes stop cleanly
        return bool(running or stopped)
