"""`chatpipe k8s render`: the manifests say what the settings and the catalog say.

Each check reads the expected value from the project's own code (the topic catalog and its replication
rule, the settings classes built from a container's variables, the worker's group ids and request topics,
the local secured broker's ACLs), not from the renderer, so a change on either side that breaks the
other fails here. No cluster, no network.
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from k8s import values as values_mod
from k8s.common import RenderError, cluster_ca_secret, settings_from_env
from k8s.kafka import kafka_users
from k8s.render import Rendered, render
from k8s.values import Values, ValuesError, load
from schemas.topics import CATALOG, replication_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def secret_files(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-test": {"tenant": "acme"}}))
    qkey = tmp_path / "qdrant.key"
    qkey.write_text("a-qdrant-key\n")
    return keys, qkey


def _values(**fields) -> Values:
    return Values.model_validate(fields)


def _secured(secret_files, **more) -> Values:
    keys, qkey = secret_files
    return _values(security=True, topic_prefix="prod.", gateway={"keys_file": str(keys)},
                   qdrant={"api_key_file": str(qkey), "replicas": 3}, **more)


VARIANTS = {
    "defaults": lambda files: Values(),
    "secured-share": lambda files: _secured(files, inference={"intake": "share", "gpus": 2},
                                            kafka={"nodes": 5, "controllers": 3}),
    "one-node-cpu-cronjob": lambda files: _values(kafka={"nodes": 1}, inference={"gpus": 0},
                                                  spark={"schedule_with": "cronjob", "source": "archive"},
                                                  model={"volume": {"kind": "emptyDir"}}),
}


def _all(rendered: Rendered) -> list[dict]:
    """Every object of every file."""
    return [obj for objs in rendered.files.values() for obj in objs]


def _objects(rendered, kind: str) -> list[dict]:
    return [o for o in _all(rendered) if o["kind"] == kind]


def _one(rendered, kind: str, name: str) -> dict:
    found = [o for o in _objects(rendered, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def _container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def _settings(cls, container: dict, monkeypatch):
    """``cls`` built from exactly the plain variables of ``container`` (as the pod's process builds it)."""
    import os

    for key in [k for k in os.environ if k.upper().startswith("CHATPIPE_")]:
        monkeypatch.delenv(key)
    for var in container["env"]:
        if "value" in var:
            monkeypatch.setenv(var["name"], var["value"])
    return cls()


def _port(container: dict, name_or_number) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name_or_number)


def _probe_ports(container: dict) -> set[int]:
    return {_port(container, container[p]["httpGet"]["port"]) for p in ("startupProbe", "readinessProbe",
                                                                        "livenessProbe")}


# --- topics -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kafka_topics_are_the_catalog(variant, secret_files):
    values = VARIANTS[variant](secret_files)
    topics = _objects(render(values), "KafkaTopic")
    by_name = {t["spec"]["topicName"]: t for t in topics}
    assert len(topics) == len(CATALOG) == len(by_name)
    assert set(by_name) == {values.topic_prefix + spec.name for spec in CATALOG}
    for spec in CATALOG:
        topic = by_name[values.topic_prefix + spec.name]
        rf, min_isr = replication_for(spec, values.kafka.nodes, values.kafka.replication_factor)
        assert topic["spec"]["partitions"] == spec.partitions, spec.name
        assert topic["spec"]["replicas"] == rf, spec.name
        assert topic["spec"]["config"] == {"cleanup.policy": spec.cleanup_policy, "retention.ms": str(spec.retention_ms),
                                           **spec.extra_config, "min.insync.replicas": str(min_isr)}, spec.name
        assert topic["metadata"]["labels"]["strimzi.io/cluster"] == values.kafka.cluster


def test_replication_follows_the_cluster_size():
    assert {t["spec"]["replicas"] for t in _objects(render(Values()), "KafkaTopic")} == {3}
    one = _objects(render(_values(kafka={"nodes": 1})), "KafkaTopic")
    assert {(t["spec"]["replicas"], t["spec"]["config"]["min.insync.replicas"]) for t in one} == {(1, "1")}
    kafka = _one(render(_values(kafka={"nodes": 1})), "Kafka", "chatpipe-kafka")
    assert kafka["spec"]["kafka"]["config"]["offsets.topic.replication.factor"] == "1"


def test_kraft_node_pools():
    dual = render(Values())
    assert [(p["metadata"]["name"], p["spec"]["roles"], p["spec"]["replicas"]) for p in _objects(dual, "KafkaNodePool")] \
        == [("brokers", ["controller", "broker"], 3)]
    split = render(_values(kafka={"nodes": 4, "controllers": 3}))
    assert [(p["spec"]["roles"], p["spec"]["replicas"]) for p in _objects(split, "KafkaNodePool")] \
        == [(["controller"], 3), (["broker"], 4)]


# --- services: ports, probes, drains from the settings --------------------------------------------------
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gateway_ports_probes_and_drain_are_its_settings(variant, secret_files, monkeypatch):
    from gateway.server import serve
    from gateway.settings import GatewaySettings

    values = VARIANTS[variant](secret_files)
    rendered = render(values)
    deployment = _one(rendered, "Deployment", "chatpipe-gateway")
    container = _container(deployment)
    s = _settings(GatewaySettings, container, monkeypatch)
    assert s.host == "0.0.0.0"
    assert [p["containerPort"] for p in container["ports"]] == [s.port]
    assert _probe_ports(container) == {s.port}
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    service = _one(rendered, "Service", "chatpipe-gateway")
    assert service["spec"]["ports"][0]["port"] == s.port
    assert _port(container, service["spec"]["ports"][0]["targetPort"]) == s.port
    mount = next(m for m in container["volumeMounts"] if m["name"] == "keys")["mountPath"]
    assert Path(s.keys_file).parent == Path(mount)
    graceful_s = inspect.signature(serve).parameters["graceful_s"].default
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= pre_stop + graceful_s + 10  # + the app's close: producer flush (10 s)


def test_a_port_changed_in_values_moves_every_port(monkeypatch):
    from gateway.settings import GatewaySettings
    from inference.worker.settings import WorkerSettings

    rendered = render(_values(gateway={"env": {"CHATPIPE_GATEWAY_PORT": "8443"}},
                              inference={"env": {"CHATPIPE_WORKER_METRICS_PORT": "9999"}}))
    gateway = _container(_one(rendered, "Deployment", "chatpipe-gateway"))
    assert _settings(GatewaySettings, gateway, monkeypatch).port == 8443 == gateway["ports"][0]["containerPort"]
    assert _probe_ports(gateway) == {8443}
    worker = _container(_one(rendered, "Deployment", "chatpipe-inference"))
    assert _settings(WorkerSettings, worker, monkeypatch).metrics_port == 9999
    assert _probe_ports(worker) == {9999}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_inference_ports_probes_drain_and_gpus(variant, secret_files, monkeypatch):
    from inference.engine.settings import EngineSettings
    from inference.worker.settings import WorkerSettings

    values = VARIANTS[variant](secret_files)
    deployment = _one(render(values), "Deployment", "chatpipe-inference")
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    s = _settings(WorkerSettings, container, monkeypatch)
    assert s.metrics_port and s.metrics_host == "0.0.0.0"
    assert [p["containerPort"] for p in container["ports"]] == [s.metrics_port] and _probe_ports(container) == {s.metrics_port}
    assert s.intake == values.inference.intake
    assert pod["terminationGracePeriodSeconds"] == math.ceil(s.grace_s) + values.inference.grace_margin_s
    engine = _settings(EngineSettings, container, monkeypatch)
    assert str(engine.model_cache) == values.model.mount_path
    gpus = values.inference.gpus
    if gpus:
        assert engine.device == "cuda"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
        assert pod["nodeSelector"] == values.inference.node_selector and pod["tolerations"]
    else:
        assert engine.device == "cpu" and "nodeSelector" not in pod
        assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(s.metrics_port)
    if values.inference.keda.enabled:
        assert "replicas" not in deployment["spec"]  # KEDA owns the count: an apply must not reset it


def test_workers_read_adapters_from_the_artifact_store_and_are_ready_once_they_hold_their_versions(monkeypatch):
    """Issue 42 point 6: the training runs' artifact store (a folder on the datasets volume) is mounted
    read-only where the versions' adapter_uri points; an object store's credentials come from a Secret; the
    adapters are copied to an emptyDir cache; readiness is the worker's /ready (holding every CANARY/LIVE
    version of its base model)."""
    from inference.worker.settings import WorkerSettings
    from k8s.services import DATASETS_MOUNT
    from k8s.training import ARTIFACTS

    deployment = _one(render(_values()), "Deployment", "chatpipe-inference")
    container, pod = _container(deployment), deployment["spec"]["template"]["spec"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["datasets"] == {"name": "datasets", "mountPath": DATASETS_MOUNT, "readOnly": True}
    assert ARTIFACTS.startswith(DATASETS_MOUNT + "/")  # where training publishes adapter_uri
    cache = _settings(WorkerSettings, container, monkeypatch).adapter_cache
    assert str(cache) == mounts["adapters"]["mountPath"]
    assert {v["name"]: v for v in pod["volumes"]}["adapters"]["emptyDir"] == {"sizeLimit": "4Gi"}

    bucket = _one(render(_values(training={"artifact_store": "s3://models/chatpipe"},
                                 inference={"adapter_store_secret": "adapter-store"})), "Deployment", "chatpipe-inference")
    worker = _container(bucket)
    assert "datasets" not in {m["name"] for m in worker["volumeMounts"]}
    assert worker["envFrom"] == [{"secretRef": {"name": "adapter-store"}}]


def test_every_gateway_replica_mounts_the_one_file_store(monkeypatch):
    """Issue 44: the Files API's store is one ReadWriteMany claim every gateway replica mounts where
    CHATPIPE_GATEWAY_FILES_URI points; an object store given in gateway.env replaces it (no claim, no
    mount); an emptyDir with several replicas is refused (a file would be on one replica only)."""
    from gateway.settings import GatewaySettings
    from k8s.services import FILES_MOUNT

    rendered = render(_values())
    container = _container(_one(rendered, "Deployment", "chatpipe-gateway"))
    assert _settings(GatewaySettings, container, monkeypatch).files_store() == FILES_MOUNT
    assert {"name": "files", "mountPath": FILES_MOUNT} in container["volumeMounts"]
    assert _one(rendered, "PersistentVolumeClaim", "chatpipe-files")["spec"]["accessModes"] == ["ReadWriteMany"]

    bucket = render(_values(gateway={"env": {"CHATPIPE_GATEWAY_FILES_URI": "s3://files/chatpipe"}}))
    gateway = _container(_one(bucket, "Deployment", "chatpipe-gateway"))
    assert "files" not in {m["name"] for m in gateway["volumeMounts"]}
    assert "chatpipe-files" not in [d["metadata"]["name"] for d in _objects(bucket, "PersistentVolumeClaim")]
    with pytest.raises(Exception, match="files.kind emptyDir with several gateway replicas"):
        _values(files={"kind": "emptyDir"})


def test_grace_follows_the_worker_setting(monkeypatch):
    rendered = render(_values(inference={"env": {"CHATPIPE_WORKER_GRACE_S": "90.5"}, "grace_margin_s": 10}))
    pod = _one(rendered, "Deployment", "chatpipe-inference")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 101


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_streams_ports_probes_and_folders(variant, secret_files, monkeypatch):
    from streams.memory_settings import MemorySettings
    from streams.settings import StreamsSettings

    values = VARIANTS[variant](secret_files)
    rendered = render(values)
    deployment = _one(rendered, "Deployment", "chatpipe-streams")
    container = _container(deployment)
    s = _settings(StreamsSettings, container, monkeypatch)
    assert s.metrics_port and s.metrics_host == "0.0.0.0"
    assert [p["containerPort"] for p in container["ports"]] == [s.metrics_port] and _probe_ports(container) == {s.metrics_port}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[str(s.state_dir)] == "state" and mounts[str(s.archive_dir)] == "archive"
    assert deployment["spec"]["replicas"] == values.streams.replicas
    memory = _settings(MemorySettings, container, monkeypatch)
    if values.qdrant.enabled:
        service = _one(rendered, "Service", "chatpipe-qdrant")
        assert memory.url == f"http://chatpipe-qdrant.{values.namespace}.svc:{service['spec']['ports'][0]['port']}"


def test_a_variable_no_setting_reads_fails_the_render():
    with pytest.raises(RenderError, match="CHATPIPE_WORKER_GRACE is read by none"):
        render(_values(inference={"env": {"CHATPIPE_WORKER_GRACE": "30"}}))
    with pytest.raises(RenderError, match="CHATPIPE_STREAMS_METRICS_PORT 0"):
        render(_values(streams={"env": {"CHATPIPE_STREAMS_METRICS_PORT": "0"}}))


def test_kafka_connection_of_every_container(secret_files):
    values = _secured(secret_files)
    rendered = render(values)
    users = {u["metadata"]["name"] for u in _objects(rendered, "KafkaUser")}
    tls_port = next(listener["port"] for listener in _one(rendered, "Kafka", "chatpipe-kafka")["spec"]["kafka"]["listeners"])
    for name, user in (("chatpipe-gateway", "chatpipe-gateway"), ("chatpipe-streams", "chatpipe-streams"),
                       ("chatpipe-inference", "chatpipe-inference")):
        container = _container(_one(rendered, "Deployment", name))
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["CHATPIPE_BOOTSTRAP_SERVERS"] == f"chatpipe-kafka-kafka-bootstrap.{values.namespace}.svc:{tls_port}"
        assert env["CHATPIPE_KAFKA_SASL_USERNAME"] == user and user in users
        assert env["CHATPIPE_TOPIC_PREFIX"] == "prod."
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert str(Path(env["CHATPIPE_KAFKA_SASL_PASSWORD_FILE"]).parent) in mounts
        assert str(Path(env["CHATPIPE_KAFKA_SSL_CA_FILE"]).parent) in mounts
        assert "CHATPIPE_KAFKA_SASL_PASSWORD" not in env  # never a password as a value
        for var in env:
            assert var.upper() in _known_variables(), var


def _known_variables() -> set[str]:
    from inference.engine.settings import EngineSettings
    from gateway.settings import GatewaySettings
    from inference.worker.settings import WorkerSettings
    from k8s.common import env_names
    from streams.cache_settings import CacheSettings
    from streams.memory_settings import MemorySettings
    from streams.settings import StreamsSettings
    from transport.settings import KafkaSettings
    from transport.spans import TracingSettings

    out = set()
    for cls in (GatewaySettings, WorkerSettings, EngineSettings, StreamsSettings, MemorySettings, CacheSettings,
                KafkaSettings, TracingSettings):
        out |= {n for field_name in cls.model_fields for n in env_names(cls, field_name)}
    return out


# --- ACLs: the local secured broker's, for Strimzi ----------------------------------------------------------
def test_kafka_users_carry_the_local_brokers_acls(secret_files):
    from infra.kafka_security import ADMIN_USER, service_acls

    values = _secured(secret_files)
    rendered = render(values)
    kafka_cr = _one(rendered, "Kafka", "chatpipe-kafka")
    assert kafka_cr["spec"]["kafka"]["authorization"] == {"type": "simple", "superUsers": [ADMIN_USER]}
    assert kafka_cr["spec"]["kafka"]["listeners"][0]["authentication"] == {"type": "scram-sha-512"}
    strimzi = set()
    for user in _objects(rendered, "KafkaUser"):
        for acl in user["spec"].get("authorization", {}).get("acls", []):
            r = acl["resource"]
            for op in acl["operations"]:
                strimzi.add((user["metadata"]["name"], r["type"], r.get("patternType", "literal"),
                             r.get("name", "kafka-cluster"), op.lower()))
    local = set()
    for b in service_acls(values.topic_prefix):
        pattern = {"LITERAL": "literal", "PREFIXED": "prefix"}[b.resource_pattern_type.name]
        local.add((b.principal.removeprefix("User:"), b.restype.name.lower().replace("broker", "cluster"),
                   pattern, b.name, b.operation.name.lower().replace("_", "")))
    assert strimzi == local


# --- KEDA ---------------------------------------------------------------------------------------------
def test_keda_partition_triggers_name_the_workers_groups_and_topics(monkeypatch):
    from inference.worker.intake import request_topics
    from inference.worker.intake_partition import partition_group_ids
    from inference.worker.settings import WorkerSettings
    from transport.settings import KafkaSettings

    values = _values(topic_prefix="staging.", inference={"intake": "partition",
                                                         "env": {"CHATPIPE_WORKER_GROUP_ID": "team-a-inference"}})
    rendered = render(values)
    worker = _container(_one(rendered, "Deployment", "chatpipe-inference"))
    ws = _settings(WorkerSettings, worker, monkeypatch)
    groups = partition_group_ids(ws)
    topics = request_topics(settings_from_env(KafkaSettings, {}, topic_prefix=values.topic_prefix))
    expected = {(groups[priority], topic) for topic, priority in topics.items()}
    scaled = _one(rendered, "ScaledObject", "chatpipe-inference")
    triggers = scaled["spec"]["triggers"]
    assert {t["type"] for t in triggers} == {"kafka"}
    assert {(t["metadata"]["consumerGroup"], t["metadata"]["topic"]) for t in triggers} == expected
    assert ("team-a-inference", "staging.chat.inference.requests") in expected
    bootstrap = next(e["value"] for e in worker["env"] if e["name"] == "CHATPIPE_BOOTSTRAP_SERVERS")
    assert {t["metadata"]["bootstrapServers"] for t in triggers} == {bootstrap}
    assert scaled["spec"]["scaleTargetRef"]["name"] == "chatpipe-inference"
    assert scaled["spec"]["maxReplicaCount"] == values.inference.keda.max_replicas


def test_keda_share_triggers_read_the_workers_backlog_metric(secret_files, monkeypatch):
    from inference.worker.intake import request_topics
    from inference.worker.intake_share import share_group_ids
    from inference.worker.settings import WorkerSettings
    from transport.settings import KafkaSettings

    values = _secured(secret_files, inference={"intake": "share"})
    topics = request_topics(settings_from_env(KafkaSettings, {}, topic_prefix=values.topic_prefix))
    rendered = render(values)
    ws = _settings(WorkerSettings, _container(_one(rendered, "Deployment", "chatpipe-inference")), monkeypatch)
    assert ws.intake == "share"
    groups = share_group_ids(ws)
    triggers = _one(rendered, "ScaledObject", "chatpipe-inference")["spec"]["triggers"]
    assert {t["type"] for t in triggers} == {"prometheus"}
    queries = {t["metadata"]["query"] for t in triggers}
    assert queries == {f'max(chatpipe_consumer_lag_records{{group="{groups[p]}",topic="{topic}"}})'
                       for topic, p in topics.items()}
    # the metric the worker exports under that name, with those labels
    from inference.worker.metrics import WorkerMetrics

    metrics = WorkerMetrics("m")
    assert metrics.lag_records._name == "chatpipe_consumer_lag_records"
    assert metrics.lag_records._labelnames == ("group", "topic")
    assert not _objects(rendered, "TriggerAuthentication")  # the Prometheus scaler does not log in to Kafka


def test_keda_secured_kafka_trigger_logs_in_as_the_worker(secret_files):
    rendered = render(_secured(secret_files, inference={"intake": "partition"}))
    auth = _one(rendered, "TriggerAuthentication", "chatpipe-inference-kafka")
    assert {r["parameter"] for r in auth["spec"]["secretTargetRef"]} == {"password", "ca"}
    assert auth["spec"]["env"] == [{"parameter": "username", "name": "CHATPIPE_KAFKA_SASL_USERNAME",
                                    "containerName": "inference"}]
    for trigger in _one(rendered, "ScaledObject", "chatpipe-inference")["spec"]["triggers"]:
        assert trigger["metadata"]["sasl"] == "scram_sha512" and trigger["metadata"]["tls"] == "enable"
        assert trigger["authenticationRef"] == {"name": "chatpipe-inference-kafka"}


def test_share_intake_cannot_scale_to_zero():
    with pytest.raises(RenderError, match="min_replicas 0 with share intake"):
        render(_values(inference={"intake": "share", "keda": {"min_replicas": 0}}))
    render(_values(inference={"intake": "partition", "keda": {"min_replicas": 0}}))  # KEDA reads the lag from Kafka


# --- Secrets --------------------------------------------------------------------------------------------
def _pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod specs of a workload object (Deployment, StatefulSet, Job, CronJob)."""
    spec = obj.get("spec", {})
    if obj["kind"] in ("Deployment", "StatefulSet", "Job"):
        return [spec["template"]["spec"]]
    if obj["kind"] == "CronJob":
        return [spec["jobTemplate"]["spec"]["template"]["spec"]]
    return []


def _referenced_secrets(objects: list[dict[str, Any]]) -> set[str]:
    """Every Secret a rendered object names: pod volumes and variables, Spark pods' volumes and
    variables, KEDA's TriggerAuthentication."""
    out = set()

    def from_pod(pod: dict[str, Any]) -> None:
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                out.add(volume["secret"]["secretName"])
        for container in [*pod.get("containers", []), *pod.get("initContainers", [])]:
            from_env(container.get("env", []))

    def from_env(env: list[dict[str, Any]]) -> None:
        for var in env:
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                out.add(ref["name"])

    for obj in objects:
        for pod in _pod_specs(obj):
            from_pod(pod)
        if obj["kind"] in ("SparkApplication", "ScheduledSparkApplication"):
            spec = obj["spec"]["template"] if obj["kind"] == "ScheduledSparkApplication" else obj["spec"]
            for volume in spec.get("volumes", []):
                if "secret" in volume:
                    out.add(volume["secret"]["secretName"])
            for role in ("driver", "executor"):
                from_env(spec[role].get("env", []))
        if obj["kind"] == "TriggerAuthentication":
            out |= {ref["name"] for ref in obj["spec"].get("secretTargetRef", [])}
    return out


def _provided_secrets(values: Values, rendered: Rendered) -> set[str]:
    """Secrets that will exist: rendered here, or made by Strimzi for the rendered Kafka and KafkaUsers."""
    own = {o["metadata"]["name"] for o in _all(rendered) if o["kind"] == "Secret"}
    strimzi = {cluster_ca_secret(values)} | {u["metadata"]["name"] for u in kafka_users(values)}
    return own | strimzi


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_referenced_secrets_exist(variant, secret_files):
    values = VARIANTS[variant](secret_files)
    rendered = render(values)
    missing = _referenced_secrets(_all(rendered)) - _provided_secrets(values, rendered)
    if values.gateway.keys_file is None:
        # not rendered without a file: each one the render says to create, by name
        assert missing and all(any(m in note for note in rendered.notes) for m in missing)
    else:
        assert not missing, missing
        assert not rendered.notes


def test_secured_render_references_strimzi_secrets(secret_files):
    values = _secured(secret_files)
    refs = _referenced_secrets(_all(render(values)))
    assert {"chatpipe-gateway", "chatpipe-streams", "chatpipe-inference", "chatpipe-jobs",
            "chatpipe-kafka-cluster-ca-cert", "chatpipe-gateway-keys", "chatpipe-qdrant"} <= refs


# --- values, files, CLI ---------------------------------------------------------------------------------
def test_values_are_checked(tmp_path):
    bad = tmp_path / "v.yaml"
    bad.write_text("streams: {replicas: 7}\n")
    with pytest.raises(ValuesError, match="streams.replicas 7: chat.prompts has 6 partitions"):
        load(bad)
    bad.write_text("gateway: {replica: 3}\n")
    with pytest.raises(ValuesError, match="gateway.replica"):
        load(bad)
    good = tmp_path / "v.json"
    good.write_text(json.dumps({"gateway": {"keys_file": "keys.json"}}))
    assert load(good).gateway.keys_file == tmp_path / "keys.json"  # relative to the values file
    with pytest.raises(RenderError, match=r"gateway.keys_file .*keys.json cannot be read: No such file"):
        render(load(good))  # a clear error, not a traceback, for a keys file that is not there


def test_render_is_deterministic(secret_files):
    from k8s.render import as_text

    values = _secured(secret_files)
    assert as_text(render(values)) == as_text(render(values))


def test_cli_writes_one_file_per_component_and_a_kustomization(tmp_path, secret_files):
    from typer.testing import CliRunner

    from chatpipe.cli import app

    keys, qkey = secret_files
    vf = tmp_path / "values.yaml"
    vf.write_text(yaml.safe_dump({"security": True, "gateway": {"keys_file": str(keys)},
                                  "qdrant": {"api_key_file": str(qkey)}}))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["k8s", "render", "--values", str(vf), "--out", str(out)])
    assert result.exit_code == 0, result.output
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    files = sorted(p.name for p in out.glob("*.yaml"))
    assert sorted(kustomization["resources"]) == sorted(set(files) - {"kustomization.yaml", "spark-run.yaml", "train-run.yaml"})
    assert (out / "secrets.yaml").stat().st_mode & 0o077 == 0
    for path in out.glob("*.yaml"):
        assert all(d is not None for d in yaml.safe_load_all(path.read_text()))
    stdout = CliRunner().invoke(app, ["k8s", "render", "--values", str(vf)])
    assert stdout.exit_code == 0 and "kind: KafkaTopic" in stdout.output and "# file: kustomization.yaml" in stdout.output


def test_every_value_is_documented():
    text = (ROOT / "docs" / "deploy.md").read_text()
    missing = [key for key, _, _ in values_mod.described() if f"| `{key}` |" not in text]
    assert not missing, f"docs/deploy.md does not name these values: {missing}"
    stale = [key for key, default, _ in values_mod.described()
             if default is not None and f"| `{key}` | `{json.dumps(default)}` |" not in text]
    assert not stale, f"docs/deploy.md gives another default for: {stale}"


# --- the address /metrics listens on (the pods set 0.0.0.0; the default stays loopback) ----------------
def test_metrics_servers_listen_on_the_settings_address(monkeypatch):
    import inference.worker.metrics as worker_metrics
    import streams.metrics as streams_metrics
    from inference.worker.settings import WorkerSettings
    from streams.settings import StreamsSettings

    bound = []
    for module in (worker_metrics, streams_metrics):
        monkeypatch.setattr(module, "start_http_server", lambda port, addr, registry: bound.append((port, addr)))
    monkeypatch.setattr(streams_metrics, "LagMonitor", lambda *a, **k: type("L", (), {"start": lambda self: None})())
    worker_metrics.WorkerMetrics("m").serve(9464, None, WorkerSettings(metrics_host="0.0.0.0"))
    worker_metrics.WorkerMetrics("m").serve(9465, None, WorkerSettings())
    streams_metrics.StreamsMetrics().serve(9474, None, [], host="0.0.0.0")
    streams_metrics.StreamsMetrics().serve(9475, None, [])
    assert bound == [(9464, "0.0.0.0"), (9465, "127.0.0.1"), (9474, "0.0.0.0"), (9475, "127.0.0.1")]
    assert WorkerSettings().metrics_host == StreamsSettings().metrics_host == "127.0.0.1"
    run_worker = (ROOT / "streams" / "app.py").read_text()
    assert "host=s.metrics_host" in run_worker  # run_worker hands the setting to serve


def test_keda_threshold_defaults_to_three_quarters_of_the_workers_max_batch(monkeypatch):
    """The docs' rule ("Autoscaling": the lag counts running requests, so a target of 3/4 of a batch adds a
    worker before the batches are full): read from the engine settings the container really gets."""
    from inference.engine.settings import EngineSettings

    cases = [({}, 24), ({"max_batch": 8}, 6), ({"env": {"CHATPIPE_MAX_BATCH": "64"}}, 48),
             ({"keda": {"lag_per_worker": 5}}, 5)]
    for inference, threshold in cases:
        rendered = render(_values(inference=inference))
        engine = _settings(EngineSettings, _container(_one(rendered, "Deployment", "chatpipe-inference")), monkeypatch)
        triggers = _one(rendered, "ScaledObject", "chatpipe-inference")["spec"]["triggers"]
        assert {t["metadata"]["threshold"] for t in triggers} == {str(threshold)}, inference
        if "lag_per_worker" not in inference.get("keda", {}):
            assert threshold == round(0.75 * engine.max_batch)


def test_the_training_run_is_a_spark_application_of_the_trainer():
    """Catches a training job that would train on nothing (no dataset, no base model), publish nowhere, or run
    another number of processes than it has executors."""
    from k8s.render import render
    from k8s.values import Values

    (app,) = render(Values(training={"processes": 3, "tenant": "acme"})).files["train-run"]
    spec = app["spec"]
    assert app["kind"] == "SparkApplication" and spec["mainApplicationFile"].endswith("/training/submit.py")
    env = {e["name"]: e.get("value") for e in spec["driver"]["env"]}
    assert env["CHATPIPE_TRAIN_PROCESSES"] == "3" == str(spec["executor"]["instances"])
    assert env["CHATPIPE_TRAIN_TENANT"] == "acme"
    assert env["CHATPIPE_TRAIN_DATASET"] == "/data/datasets/finetune-dataset"
    assert env["CHATPIPE_TRAIN_MODEL_PATH"].startswith("/models/")
    assert spec["executor"]["env"] == spec["driver"]["env"]
    mounts = {m["name"]: m["mountPath"] for m in spec["executor"]["volumeMounts"]}
    assert mounts["datasets"] == "/data/datasets" and mounts["model"] == "/models"
    assert "train-run" not in render(Values(spark={"schedule_with": "cronjob"})).files
