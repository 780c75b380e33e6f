"""The catalog's replication rule, without a cluster: 3 copies / 2 in sync from 3 brokers up, else 1 / 1."""

from __future__ import annotations

import pytest

from infra.cluster_settings import ClusterSettings
from schemas.topics import CATALOG, TopicSpec, replication_for


@pytest.mark.parametrize(("brokers", "want"), [(1, (1, 1)), (2, (1, 1)), (3, (3, 2)), (5, (3, 2))])
def test_rule_follows_the_cluster_size(brokers, want):
    """A single broker must keep 1 replica (Kafka rejects more than there are brokers) and a
    3-node cluster must get 3 copies with 2 required, so one dead node loses no acknowledged write."""
    assert {replication_for(spec, brokers) for spec in CATALOG} == {want}


def test_explicit_values_win_and_min_isr_never_exceeds_the_copies():
    """A topic's own replication (or a deployment's explicit factor) overrides the rule; a
    min.insync.replicas above the replica count would make every acks=all write fail."""
    spec = TopicSpec("t", 1, "k", "v", replication_factor=2)
    assert replication_for(spec, 3) == (2, 1)
    assert replication_for(TopicSpec("t", 1, "k", "v"), 3, replication_factor=1) == (1, 1)
    assert replication_for(TopicSpec("t", 1, "k", "v", min_insync_replicas=5), 3) == (3, 3)


def test_cluster_ports_must_name_every_node():
    """Explicit ports for fewer nodes than --brokers must be a settings error, not a node without a port."""
    with pytest.raises(ValueError, match="client_ports names 2 port"):
        ClusterSettings(brokers=3, client_ports=(1, 2))
    settings = ClusterSettings(brokers=3, cluster_base_port=20000)
    assert settings.bootstrap_servers == "127.0.0.1:20000,127.0.0.1:20002,127.0.0.1:20004"
    assert [settings.controller_port(n) for n in settings.node_ids] == [20001, 20003, 20005]
