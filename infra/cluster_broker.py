"""The Kafka of a stack started with ``chatpipe up --brokers N`` (N > 1): a KRaft cluster.

``infra.stack.LocalStack`` drives its broker through a small interface (``up``, ``down``,
``killed``, ``pid``, ``running``, ``answers``, ``logs_dir``, ``bootstrap_servers``) that
``LocalKafka`` has; this subclass gives ``KafkaCluster`` the rest of it (its ``up`` and ``down``
return the nodes started or stopped: empty, false, when there were none), so the services, health
checks and ``down`` work unchanged on a cluster. The nodes take the cluster's own ports
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


class ClusterBroker(KafkaCluster):
    killed = False  # KafkaCluster.down escalates to SIGKILL itself and does not say; nodes stop cleanly

    def __init__(self, settings: StackSettings) -> None:
        super().__init__(cluster_settings(settings))
        self.logs_dir: Path = self.node(1).logs_dir

    def pids(self) -> list[int]:
        return [pid for node in self.nodes.values() if (pid := node.pid()) is not None]

    def pid(self) -> int | None:
        return next(iter(self.pids()), None)

    def running(self) -> bool:
        """Every node runs."""
        return len(self.pids()) == len(self.nodes)

    def answers(self) -> bool:
        return len(self.live_brokers()) == len(self.nodes)
