"""Kafka on Kubernetes with Strimzi (``kafka.strimzi.io/v1``, Strimzi 1.2): a ``Kafka`` in KRaft mode with
its ``KafkaNodePool``s, one ``KafkaTopic`` per topic of the catalog (``schemas/topics.py``: partitions,
replication and configs as ``chatpipe topics apply`` gives them, through the same ``replication_for``),
and with security one ``KafkaUser`` per service holding the ACLs the local secured broker gives it
(``infra/kafka_security.py``), plus the admin user.

Topics the services create themselves (each gateway's reply topic, Faust's changelog) are not
``KafkaTopic``s: Strimzi's topic operator leaves topics it does not manage alone, and the services get
``CHATPIPE_REPLICATION_FACTOR`` so those are replicated like the catalog's.
"""

from __future__ import annotations

import re
from typing import Any

from k8s.common import KAFKA_PLAIN_PORT, KAFKA_TLS_PORT, labels, resources
from k8s.values import Values
from schemas.topics import CATALOG, replication_for

API = "kafka.strimzi.io/v1"
#: Broker settings of the local stack's brokers (infra/local_kafka.py, infra/kafka_cluster.py) that are
#: not about replication: topics only from the catalog, never an unclean leader, share groups that hand
#: a dead member's records back within 10 s (Kafka's 45 s default leaves a crashed worker's prompts
#: waiting that long).
BROKER_CONFIG = {
    "auto.create.topics.enable": "false",
    "unclean.leader.election.enable": "false",
    "group.share.min.session.timeout.ms": "6000",
    "group.share.session.timeout.ms": "10000",
    "group.share.min.heartbeat.interval.ms": "1000",
    "group.share.heartbeat.interval.ms": "2000",
}
#: ACL operations of infra/kafka_security.py (the admin API's names) -> Strimzi's.
OPERATIONS = {"READ": "Read", "WRITE": "Write", "CREATE": "Create", "DELETE": "Delete", "ALTER": "Alter",
              "DESCRIBE": "Describe", "DESCRIBE_CONFIGS": "DescribeConfigs", "ALTER_CONFIGS": "AlterConfigs",
              "IDEMPOTENT_WRITE": "IdempotentWrite", "ALL": "All"}


def _strimzi_labels(values: Values) -> dict[str, str]:
    return {**labels("kafka"), "strimzi.io/cluster": values.kafka.cluster}


def topic_object_name(topic: str) -> str:
    """A Kubernetes name for ``topic`` (the real name is ``spec.topicName``): lower case, dots and dashes."""
    return re.sub(r"[^a-z0-9.-]", "-", topic.lower()).strip(".-")[:253]


def broker_config(values: Values) -> dict[str, str]:
    """The cluster's own replication (internal topics like the catalog's) and ``BROKER_CONFIG``."""
    rf, min_isr = replication_for(CATALOG[0], values.kafka.nodes, values.kafka.replication_factor)
    return {"default.replication.factor": str(rf), "min.insync.replicas": str(min_isr),
            "offsets.topic.replication.factor": str(rf), "transaction.state.log.replication.factor": str(rf),
            "transaction.state.log.min.isr": str(min_isr), "share.coordinator.state.topic.replication.factor": str(rf),
            "share.coordinator.state.topic.min.isr": str(min_isr), **BROKER_CONFIG, **values.kafka.config}


def kafka_cluster(values: Values) -> dict[str, Any]:
    k = values.kafka
    if values.security:
        listener = {"name": "tls", "port": KAFKA_TLS_PORT, "type": "internal", "tls": True,
                    "authentication": {"type": "scram-sha-512"}}
    else:
        listener = {"name": "plain", "port": KAFKA_PLAIN_PORT, "type": "internal", "tls": False}
    kafka: dict[str, Any] = {"version": k.version, "metadataVersion": k.metadata_version, "listeners": [listener],
                             "config": broker_config(values)}
    if values.security:
        from infra.kafka_security import ADMIN_USER

        kafka["authorization"] = {"type": "simple", "superUsers": [ADMIN_USER]}
    return {"apiVersion": API, "kind": "Kafka",
            "metadata": {"name": k.cluster, "namespace": values.namespace, "labels": labels("kafka")},
            "spec": {"kafka": kafka, "entityOperator": {"topicOperator": {}, "userOperator": {}}}}


def node_pools(values: Values) -> list[dict[str, Any]]:
    k = values.kafka
    volume = {"id": 0, "type": "persistent-claim", "size": k.storage_size, "deleteClaim": k.delete_claim,
              "kraftMetadata": "shared", **({"class": k.storage_class} if k.storage_class else {})}
    pool_resources = resources(k.resources)
    pools = [("brokers", k.nodes, ["broker"] if k.controllers else ["controller", "broker"])]
    if k.controllers:
        pools.insert(0, ("controllers", k.controllers, ["controller"]))
    return [{"apiVersion": API, "kind": "KafkaNodePool",
             "metadata": {"name": pool, "namespace": values.namespace, "labels": _strimzi_labels(values)},
             "spec": {"replicas": replicas, "roles": roles, "storage": {"type": "jbod", "volumes": [dict(volume)]},
                      **({"resources": pool_resources} if pool_resources else {})}}
            for pool, replicas, roles in pools]


def kafka_topics(values: Values) -> list[dict[str, Any]]:
    out = []
    for spec in CATALOG:
        topic = f"{values.topic_prefix}{spec.name}"
        # replicas and config as TopicAdmin.apply sets them (transport/admin.py)
        replicas, min_isr = replication_for(spec, values.kafka.nodes, values.kafka.replication_factor)
        out.append({"apiVersion": API, "kind": "KafkaTopic",
                    "metadata": {"name": topic_object_name(topic), "namespace": values.namespace,
                                 "labels": _strimzi_labels(values), "annotations": {"chatpipe.dev/doc": spec.doc}},
                    "spec": {"topicName": topic, "partitions": spec.partitions, "replicas": replicas,
                             "config": {**spec.config(), "min.insync.replicas": str(min_isr)}}})
    return out


def acls(service: str, topic_prefix: str) -> list[dict[str, Any]]:
    """Strimzi ACLs of ``service``: ``infra.kafka_security.service_acls``'s, rule for rule."""
    from infra.kafka_security import _topic_rules  # the one table of who reads and writes what

    out = [{"resource": {"type": "topic", "name": f"{topic_prefix}{topic}",
                         "patternType": "literal" if pattern == "LITERAL" else "prefix"},
            "operations": [OPERATIONS[o] for o in operations], "host": "*"}
           for pattern, topic, operations in _topic_rules(service)]
    # Groups: any name (as service_acls); the worker also sets its share groups' configs.
    group_ops = ("READ", "DESCRIBE", "DESCRIBE_CONFIGS", "ALTER_CONFIGS") if service == "inference" else ("READ", "DESCRIBE")
    out.append({"resource": {"type": "group", "name": "*", "patternType": "literal"},
                "operations": [OPERATIONS[o] for o in group_ops], "host": "*"})
    cluster_ops = ("DESCRIBE",) if service == "jobs" else ("DESCRIBE", "IDEMPOTENT_WRITE")
    out.append({"resource": {"type": "cluster"}, "operations": [OPERATIONS[o] for o in cluster_ops], "host": "*"})
    return out


def kafka_users(values: Values) -> list[dict[str, Any]]:
    """One SCRAM-SHA-512 user per service with its ACLs, and the admin user (a super user: the topic
    catalog, `chatpipe status`, `chatpipe forget`, a person's shell). Strimzi's user operator makes each
    user's password and keeps it in a Secret of the user's name (key ``password``)."""
    if not values.security:
        return []
    from infra.kafka_security import ADMIN_USER, SERVICE_USERS

    users = [(user, {"type": "simple", "acls": acls(service, values.topic_prefix)})
             for service, user in SERVICE_USERS.items()]
    users.append((ADMIN_USER, None))
    return [{"apiVersion": API, "kind": "KafkaUser",
             "metadata": {"name": user, "namespace": values.namespace, "labels": _strimzi_labels(values)},
             "spec": {"authentication": {"type": "scram-sha-512"},
                      **({"authorization": authz} if authz is not None else {})}}
            for user, authz in users]


def render(values: Values) -> list[dict[str, Any]]:
    return [*node_pools(values), kafka_cluster(values), *kafka_topics(values), *kafka_users(values)]

