"""One three-node Kafka cluster (real KRaft JVMs) on free loopback ports, shared by a test module.

Every JVM it starts is stopped at the end, also when a test fails: all nodes get SIGTERM at
once, and any still alive after the stop timeout gets SIGKILL.
"""

from __future__ import annotations

import signal

import pytest

from chatpipe.testing.ports import free_port


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from infra.cluster_settings import ClusterSettings
    from infra.kafka_cluster import KafkaCluster

    settings = ClusterSettings(state_dir=tmp_path_factory.mktemp("kafka-cluster"), brokers=3,
                               client_ports=tuple(free_port() for _ in range(3)),
                               controller_ports=tuple(free_port() for _ in range(3)),
                               start_timeout_s=150, stop_timeout_s=15)
    kafka = KafkaCluster(settings)
    try:
        kafka.up()
        yield kafka
    finally:
        kafka.down()
        for node in kafka.nodes.values():  # belt and braces: nothing of ours outlives the tests
            node.signal(signal.SIGKILL, 5.0)
        assert all(node.pid() is None for node in kafka.nodes.values())
