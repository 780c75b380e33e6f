"""Autoscaling of the inference workers with KEDA (``keda.sh/v1alpha1``): one ``ScaledObject`` on their
Deployment, its triggers named after the worker's real groups and topics
(``inference.worker.metrics.lag_groups``, the same list the worker measures its lag for):

- partition intake: KEDA's Kafka scaler, one trigger per consumer group and request topic
  (``chatpipe-inference`` on ``chat.inference.requests``, ``chatpipe-inference.batch`` on
  ``...requests.batch``): KEDA reads the group's lag from the brokers itself, so it can scale from zero;
  it never asks for more workers than the topic has partitions (a further member would idle);
- share intake: KEDA's Kafka scaler reads consumer groups only (share groups keep no offsets to
  compare), so the triggers are KEDA's Prometheus scaler on the workers' own backlog gauge
  ``chatpipe_consumer_lag_records{group, topic}`` (records not yet acknowledged, measured by each worker
  for its share groups: every worker reports the same group-wide value, hence ``max``). A share group
  has no partition bound: any number of workers take records. Scaling from zero is impossible here
  (with no worker, nobody reports the backlog), so the floor is one worker.

With security the Kafka triggers log in as the workers' own user (``TriggerAuthentication``: the user
name from the worker container's variable, the password from Strimzi's KafkaUser Secret, the cluster CA).
The detailed rules (thresholds, their reasons, the capacity they imply) are docs/deploy.md "Autoscaling".
"""

from __future__ import annotations

from typing import Any

from k8s.common import (RenderError, bootstrap_servers, cluster_ca_secret, env_var, kafka_user, meta, name,
                        settings_from_env)
from k8s.values import Values

API = "keda.sh/v1alpha1"
AUTH = "chatpipe-inference-kafka"
#: The workers' consumer groups start at the earliest offset (transport/group_reader.py), so a group
#: without committed offsets has its whole topic waiting.
OFFSET_RESET = "earliest"


def worker_groups(values: Values):
    """(group, topic, kind) of each group an inference container joins, as ``lag_groups`` lists them."""
    from inference.worker.metrics import lag_groups
    from inference.worker.settings import WorkerSettings
    from k8s.services import inference_env
    from transport.settings import KafkaSettings

    # names only: the shell's own CHATPIPE_KAFKA_* (a CA file here) must not count
    kafka = settings_from_env(KafkaSettings, {}, topic_prefix=values.topic_prefix,
                              bootstrap_servers=bootstrap_servers(values))
    worker = settings_from_env(WorkerSettings, inference_env(values))  # as an inference container builds it
    return [(g.group, topic, g.kind) for g in lag_groups(kafka, worker) for topic in g.topics]


def lag_per_worker(values: Values) -> int:
    """The scaler's target per worker: the value, else ``capacity.keda.default_lag_threshold`` of the
    engine's max batch the containers get (3/4 of it)."""
    from capacity.keda import default_lag_threshold
    from inference.engine.settings import EngineSettings
    from k8s.services import inference_env

    # the EngineSettings an inference container builds from its variables
    return values.inference.keda.lag_per_worker or default_lag_threshold(
        settings_from_env(EngineSettings, inference_env(values)).max_batch)


def triggers(values: Values) -> list[dict[str, Any]]:
    k = values.inference.keda
    lag = str(lag_per_worker(values))
    out = []
    for group, topic, kind in worker_groups(values):
        trigger_name = "batch" if topic.endswith(".batch") else "interactive"
        if kind == "consumer":
            metadata = {"bootstrapServers": bootstrap_servers(values), "consumerGroup": group, "topic": topic,
                        "lagThreshold": lag, "activationLagThreshold": str(k.activation_lag),
                        "offsetResetPolicy": OFFSET_RESET, "allowIdleConsumers": "false"}
            trigger: dict[str, Any] = {"type": "kafka", "name": trigger_name, "metadata": metadata}
            if values.security:
                metadata |= {"sasl": "scram_sha512", "tls": "enable"}
                trigger["authenticationRef"] = {"name": AUTH}
        else:
            query = f'max(chatpipe_consumer_lag_records{{group="{group}",topic="{topic}"}})'
            trigger = {"type": "prometheus", "name": trigger_name,
                       "metadata": {"serverAddress": k.prometheus_url, "query": query, "threshold": lag,
                                    "activationThreshold": str(k.activation_lag), "ignoreNullValues": "true"}}
        out.append(trigger)
    return out


def trigger_authentication(values: Values) -> list[dict[str, Any]]:
    if not values.security or values.inference.intake != "partition":
        return []
    from transport.settings import KafkaSettings

    return [{"apiVersion": API, "kind": "TriggerAuthentication", "metadata": meta(values, AUTH, "inference"),
             "spec": {"env": [{"parameter": "username", "name": env_var(KafkaSettings, "sasl_username"),
                               "containerName": "inference"}],
                      "secretTargetRef": [
                          {"parameter": "password", "name": kafka_user("inference"), "key": "password"},
                          {"parameter": "ca", "name": cluster_ca_secret(values), "key": "ca.crt"}]}}]


def render(values: Values) -> list[dict[str, Any]]:
    k = values.inference.keda
    if not k.enabled:
        return []
    floor = k.min_replicas
    if values.inference.intake == "share" and floor < 1:
        raise RenderError("inference.keda.min_replicas 0 with share intake: with no worker nobody reports the share "
                          "groups' backlog (chatpipe_consumer_lag_records), so KEDA could never scale up again; "
                          "use 1 or more")
    scaled = {"apiVersion": API, "kind": "ScaledObject", "metadata": meta(values, name("inference"), "inference"),
              "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name("inference")},
                       "minReplicaCount": floor, "maxReplicaCount": k.max_replicas,
                       "pollingInterval": k.polling_interval_s, "cooldownPeriod": k.cooldown_s,
                       # Kubernetes' own default, written out: the lowest recommendation of the last 5 min
                       # (the default policies otherwise; capacity/ simulates exactly these).
                       "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                           "scaleDown": {"stabilizationWindowSeconds": 300}}}},
                       "triggers": triggers(values)}}
    return [*trigger_authentication(values), scaled]
