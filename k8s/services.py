"""The pipeline's own tiers on Kubernetes: the gateway, the streams workers, the inference workers, Qdrant,
their volumes and Secrets.

Each container is configured only through its ``CHATPIPE_*`` variables, and what Kubernetes needs to know
of it (the port it serves, the probes' port, how long a SIGTERM drain takes) is read from the settings
object those variables build (``common.settings_from_env``), never written twice:

| tier | kind | ports, probes | SIGTERM drain -> terminationGracePeriodSeconds |
|---|---|---|---|
| gateway | Deployment + Service + HPA | ``GatewaySettings.port``: ``/healthz`` (ready once its reply consumer is assigned), ``/metrics`` (alive) | preStop pause + uvicorn's ``graceful_s`` (``serve``'s default) + the app's close (producer flush, 10 s) |
| streams | Deployment (its table lives in memory and is restored from the changelog at every start; the data folder is scratch) | ``StreamsSettings.metrics_port``: ``/metrics`` | ``streams.termination_grace_s`` (Faust's stop, archive flush, reply producer close) |
| inference | Deployment on the GPU node pool | ``WorkerSettings.metrics_port``: ``/metrics`` (served once the model is loaded) | ``WorkerSettings.grace_s`` + ``inference.grace_margin_s`` |
| qdrant | StatefulSet (official image; cluster mode from 2 peers) | 6333: ``/readyz``, ``/livez`` | Qdrant's default |
| redis | Deployment + Service (official image; a cache: maxmemory + policy from ``StackSettings``, no persistence) | 6379: ``PING`` (ready), the port open (alive) | Redis's default |

The workers' ``/metrics`` listen on loopback by default; here ``metrics_host`` is ``0.0.0.0`` so that the
kubelet's probes and Prometheus reach them.
"""

from __future__ import annotations

import inspect
import json
import math
from typing import Any

from k8s.values import FILES_ENV
from k8s.common import (RenderError, check_env, claim, container_security, env_list, env_of, env_var, http_probe,
                              kafka_env, kafka_volumes, labels, meta, name, pdb, pod_spec_common, resources,
                              scrape_annotations, selector, settings_from_env, tracing_env, volume_source)
from k8s.values import Values

GATEWAY_KEYS_SECRET = "chatpipe-gateway-keys"
GATEWAY_KEYS_MOUNT = "/etc/chatpipe/gateway"
QDRANT_SECRET = "chatpipe-qdrant"
QDRANT_SECRET_KEY = "api-key"
QDRANT_KEY_REF = {"secretKeyRef": {"name": QDRANT_SECRET, "key": QDRANT_SECRET_KEY}}  # Qdrant's and streams' key
QDRANT_HTTP, QDRANT_GRPC, QDRANT_P2P = 6333, 6334, 6335  # Qdrant's own ports
REDIS_PORT = 6379  # Redis's own port (the Service's too)
REDIS_UID = 999  # the `redis` user of the official image
STREAMS_STATE = "/var/lib/chatpipe/streams"
ARCHIVE_MOUNT = "/data/archive"
DATASETS_MOUNT = "/data/datasets"
FILES_MOUNT = "/data/files"  # the Files API's store, every gateway replica's (values.files)
ADAPTER_CACHE_MOUNT = "/var/cache/chatpipe/adapters"  # the workers' copies of model versions' adapters
#: GatewayService.close flushes its producer for up to 10 s (gateway/service.py).
GATEWAY_CLOSE_S = 10


def _kafka_classes():
    from transport.settings import KafkaSettings
    from transport.spans import TracingSettings

    return [KafkaSettings, TracingSettings]


def _container(values: Values, component: str, args: list[str], env: dict[str, str], **extra: Any) -> dict[str, Any]:
    return {"name": component, "image": values.image, "imagePullPolicy": values.image_pull_policy,
            "command": ["chatpipe"], "args": args, "env": env_list(env), "securityContext": container_security(),
            **extra}


def _deployment(values: Values, component: str, pod: dict[str, Any], *, replicas: int | None,
                strategy: dict[str, Any], annotations: dict[str, str]) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": {"matchLabels": selector(component)}, "strategy": strategy,
                            "template": {"metadata": {"labels": labels(component, component),
                                                      **({"annotations": annotations} if annotations else {})},
                                         "spec": {**pod_spec_common(values), **pod}}}
    if replicas is not None:  # None: an autoscaler owns the count (an apply must not reset it)
        spec = {"replicas": replicas, **spec}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(values, name(component), component),
            "spec": spec}


def _worker_container(values: Values, component: str, env: dict[str, str], metrics_port: int, *,
                      startup_probe: dict[str, Any], readiness_path: str = "/metrics", **extra: Any) -> dict[str, Any]:
    """A streams or inference worker's container: ``chatpipe <component>``, probed on its ``/metrics``
    (readiness: ``readiness_path``)."""
    return _container(values, component, [component], env,
                      ports=[{"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"}],
                      startupProbe=startup_probe, readinessProbe=http_probe(readiness_path, "metrics", 10, 3),
                      livenessProbe=http_probe("/metrics", "metrics", 10, 6, timeout_s=5), **extra)


def _worker_pod(values: Values, grace_s: int, container: dict[str, Any],
                volumes: list[dict[str, Any]]) -> dict[str, Any]:
    """A worker's pod: the model's init containers (if any) before ``container``."""
    init = model_init(values)
    return {"terminationGracePeriodSeconds": grace_s, **({"initContainers": init} if init else {}),
            "containers": [container], "volumes": volumes}


# --- gateway --------------------------------------------------------------------------------------------
def gateway_env(values: Values) -> dict[str, str]:
    from gateway.settings import GatewaySettings

    port = GatewaySettings.model_fields["port"].default
    env = {**env_of(GatewaySettings, host="0.0.0.0", port=port, keys_file=f"{GATEWAY_KEYS_MOUNT}/keys.json",
                    files_uri=FILES_MOUNT),
           **kafka_env(values, "gateway"), **tracing_env(values), **values.gateway.env}
    check_env(env, [GatewaySettings, *_kafka_classes()], "gateway")
    return env


def gateway(values: Values) -> list[dict[str, Any]]:
    from gateway.server import serve
    from gateway.settings import GatewaySettings

    env = gateway_env(values)
    s = settings_from_env(GatewaySettings, env)
    kafka_vols, kafka_mounts = kafka_volumes(values, "gateway")
    # How long uvicorn lets open requests finish after SIGTERM: serve's graceful_s.
    graceful_s = inspect.signature(serve).parameters["graceful_s"].default
    grace = values.gateway.stop_delay_s + math.ceil(graceful_s) + GATEWAY_CLOSE_S
    container = _container(
        values, "gateway", ["gateway"], env,
        ports=[{"name": "http", "containerPort": s.port, "protocol": "TCP"}],
        # Started once its reply topic exists and its consumer is assigned; alive while it answers HTTP (a
        # broker outage makes /healthz 503, which takes the pod out of the Service but does not restart it).
        startupProbe=http_probe("/healthz", "http", 2, 90),
        readinessProbe=http_probe("/healthz", "http", 5, 2),
        livenessProbe=http_probe("/metrics", "http", 10, 3),
        **({"lifecycle": {"preStop": {"sleep": {"seconds": values.gateway.stop_delay_s}}}}
           if values.gateway.stop_delay_s else {}),
        resources=resources(values.gateway.resources),
        volumeMounts=[{"name": "keys", "mountPath": GATEWAY_KEYS_MOUNT, "readOnly": True}, *kafka_mounts])
    pod = {"terminationGracePeriodSeconds": grace, "containers": [container],
           "volumes": [{"name": "keys", "secret": {"secretName": GATEWAY_KEYS_SECRET}}, *kafka_vols]}
    if s.files_uri == FILES_MOUNT:  # not an object store given in gateway.env: the shared files volume
        container["volumeMounts"].append({"name": "files", "mountPath": FILES_MOUNT})
        pod["volumes"].append(volume_source(values.files, "files"))
    hpa = values.gateway.hpa
    out = [_deployment(values, "gateway", pod, replicas=None if hpa.enabled else values.gateway.replicas,
                       strategy={"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0}},
                       annotations=scrape_annotations(values, s.port)),
           {"apiVersion": "v1", "kind": "Service", "metadata": meta(values, name("gateway"), "gateway"),
            "spec": {"type": values.gateway.service_type, "selector": selector("gateway"),
                     "ports": [{"name": "http", "port": s.port, "targetPort": "http", "protocol": "TCP"}]}},
           pdb(values, "gateway")]
    if hpa.enabled:
        out.append(gateway_hpa(values, s.max_pending))
    return out


def gateway_hpa(values: Values, max_pending: int) -> dict[str, Any]:
    hpa = values.gateway.hpa
    if hpa.metric == "cpu":
        metric = {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization",
                                                                           "averageUtilization": hpa.cpu_percent}}}
    else:  # requests in flight per gateway, from its /metrics through a custom-metrics adapter
        target = hpa.pending_per_pod or max(1, max_pending // 2)
        metric = {"type": "Pods", "pods": {"metric": {"name": "chatpipe_gateway_pending"},
                                           "target": {"type": "AverageValue", "averageValue": str(target)}}}
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": meta(values, name("gateway"), "gateway"),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name("gateway")},
                     "minReplicas": hpa.min_replicas, "maxReplicas": hpa.max_replicas, "metrics": [metric],
                     # Up at once, down slowly: a gateway that goes takes its open streams with it.
                     "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300,
                                                "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]}}}}


# --- the model (inference workers and the streams tier's tokenizer) -------------------------------------
def model_env(values: Values) -> dict[str, str]:
    from inference.engine.settings import EngineSettings

    path = f"{values.model.mount_path.rstrip('/')}/{values.model.path}" if values.model.path else None
    return env_of(EngineSettings, model_cache=values.model.mount_path, model_path=path)


def model_init(values: Values) -> list[dict[str, Any]]:
    """Init containers that make the model there before a worker starts: on a pod's own emptyDir (or its
    node's hostPath) a pull; on a claim shared by all pods a wait for the pull Job (one writer, so two pods
    never convert into one folder at once)."""
    from inference.engine.model_store import COMPLETE_MARKER
    from inference.engine.settings import EngineSettings

    m = values.model
    if not m.pull or m.path:
        return []
    mount = [{"name": "model", "mountPath": m.mount_path}]
    if m.volume.kind != "pvc":  # the pod's own folder (emptyDir) or its node's (hostPath)
        return [_container(values, "model-pull", ["model", "pull"], model_env(values), volumeMounts=mount)]
    # The file `chatpipe model pull` writes last into the model volume (the default model complete).
    marker = settings_from_env(EngineSettings, model_env(values)).default_model_dir() / COMPLETE_MARKER
    return [{"name": "model-wait", "image": values.image, "imagePullPolicy": values.image_pull_policy,
             "command": ["sh", "-c", f"until [ -f '{marker}' ]; do echo 'waiting for the model ({marker})'; "
                                     "sleep 5; done"],
             "securityContext": container_security(), "volumeMounts": [{**mount[0], "readOnly": True}]}]


def model_pull_job(values: Values) -> list[dict[str, Any]]:
    m = values.model
    if not m.pull or m.path or m.volume.kind != "pvc":
        return []
    pull = _container(values, "model-pull", ["model", "pull"], model_env(values),
                      volumeMounts=[{"name": "model", "mountPath": m.mount_path}])
    return [{"apiVersion": "batch/v1", "kind": "Job", "metadata": meta(values, name("model-pull"), "model"),
             # Gone 10 min after it finished (a Job's pod template cannot change: the next apply, with a
             # new image say, makes a new one, which finds the model there and ends at once).
             "spec": {"backoffLimit": 6, "ttlSecondsAfterFinished": 600, "template": {
                 "metadata": {"labels": labels("model-pull", "model")},
                 "spec": {**pod_spec_common(values), "restartPolicy": "OnFailure", "containers": [pull],
                          "volumes": [volume_source(m.volume, "model")]}}}}]


# --- streams --------------------------------------------------------------------------------------------
def streams_env(values: Values) -> dict[str, str]:
    from infra.settings import StackSettings
    from streams.memory_settings import MemorySettings
    from streams.settings import StreamsSettings

    metrics_port = StackSettings.model_fields["streams_metrics_port"].default  # the stack's port, here too
    from streams.cache_settings import CacheSettings

    return {**env_of(StreamsSettings, state_dir=STREAMS_STATE, archive_dir=ARCHIVE_MOUNT, metrics_port=metrics_port,
                       metrics_host="0.0.0.0"),
            **env_of(MemorySettings, url=qdrant_url(values)), **env_of(CacheSettings, url=redis_url(values)),
            **model_env(values), **kafka_env(values, "streams"), **tracing_env(values), **values.streams.env}


def streams(values: Values) -> list[dict[str, Any]]:
    from inference.engine.settings import EngineSettings
    from streams.cache_settings import CacheSettings
    from streams.memory_settings import MemorySettings
    from streams.settings import StreamsSettings

    env = streams_env(values)
    check_env(env, [StreamsSettings, MemorySettings, CacheSettings, EngineSettings, *_kafka_classes()], "streams")
    s = settings_from_env(StreamsSettings, env)
    if not s.metrics_port:
        raise RenderError("streams: CHATPIPE_STREAMS_METRICS_PORT 0 turns /metrics off, which the probes need")
    kafka_vols, kafka_mounts = kafka_volumes(values, "streams")
    # /metrics is served once the embedding model is loaded, just before Faust starts.
    container = _worker_container(
        values, "streams", env, s.metrics_port, startup_probe=http_probe("/metrics", "metrics", 5, 120),
        resources=resources(values.streams.resources),
        volumeMounts=[{"name": "state", "mountPath": str(s.state_dir)},
                      {"name": "archive", "mountPath": str(s.archive_dir)},
                      {"name": "model", "mountPath": values.model.mount_path, "readOnly": True}, *kafka_mounts])
    if values.qdrant.api_key and values.qdrant.enabled:
        container["env"].append({"name": env_var(MemorySettings, "api_key"), "valueFrom": QDRANT_KEY_REF})
    if values.redis.password_secret:  # an external Redis's AUTH password, never a value in the manifest
        container["env"].append({"name": env_var(CacheSettings, "password"), "valueFrom": {"secretKeyRef": {
            "name": values.redis.password_secret, "key": values.redis.password_key}}})
    pod = _worker_pod(values, values.streams.termination_grace_s, container,
                      [{"name": "state", "emptyDir": {}}, volume_source(values.archive, "archive"),
                       volume_source(values.model.volume, "model"), *kafka_vols])
    # One worker at a time: each change of membership is one rebalance of the group, and a surge pod
    # beyond the partitions would own nothing.
    return [_deployment(values, "streams", pod, replicas=values.streams.replicas,
                        strategy={"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
                        annotations=scrape_annotations(values, s.metrics_port)),
            pdb(values, "streams")]


# --- inference ------------------------------------------------------------------------------------------
def inference_env(values: Values) -> dict[str, str]:
    from inference.engine.settings import EngineSettings
    from inference.worker.settings import WorkerSettings
    from infra.settings import StackSettings

    metrics_port = StackSettings.model_fields["worker_metrics_port"].default  # the stack's port, here too
    iv = values.inference
    max_batch = iv.max_batch or (GPU_MAX_BATCH if iv.gpus else None)
    return {**env_of(WorkerSettings, intake=iv.intake, metrics_port=metrics_port, metrics_host="0.0.0.0"),
            **env_of(EngineSettings, device="cuda" if iv.gpus else "cpu", max_batch=max_batch),
            **model_env(values),
            **kafka_env(values, "inference"), **tracing_env(values), **values.inference.env}


GPU_MAX_BATCH = 32  # what the docs/benchmarks.md "GPU" runs measured on one H200 (and capacity/figures.py's GPU curves)


def inference(values: Values) -> list[dict[str, Any]]:
    from inference.engine.settings import EngineSettings
    from inference.worker.settings import WorkerSettings

    env = inference_env(values)
    check_env(env, [WorkerSettings, EngineSettings, *_kafka_classes()], "inference")
    s = settings_from_env(WorkerSettings, env)
    if not s.metrics_port:
        raise RenderError("inference: CHATPIPE_WORKER_METRICS_PORT 0 turns /metrics off, which the probes and the "
                          "autoscaler need")
    iv = values.inference
    gpu = {"nvidia.com/gpu": str(iv.gpus)} if iv.gpus else None
    kafka_vols, kafka_mounts = kafka_volumes(values, "inference")
    adapter_vols, adapter_mounts = _adapter_volumes(values)
    # /metrics is served once the model is loaded (minutes for a large model on a cold node); /ready once it
    # serves and holds every CANARY/LIVE version of its base model (docs/worker.md, "Model versions").
    container = _worker_container(
        values, "inference", env, s.metrics_port, startup_probe=http_probe("/metrics", "metrics", 10, 90),
        readiness_path="/ready", resources=resources(iv.resources, gpu),
        volumeMounts=[{"name": "model", "mountPath": values.model.mount_path, "readOnly": True},
                      {"name": "shm", "mountPath": "/dev/shm"}, *adapter_mounts, *kafka_mounts])
    container["env"].append({"name": env_var(WorkerSettings, "adapter_cache"), "value": ADAPTER_CACHE_MOUNT})
    if iv.adapter_store_secret:
        container["envFrom"] = [{"secretRef": {"name": iv.adapter_store_secret}}]
    # Heartbeats and answers carry the pod's name (a restarted container keeps it).
    container["env"].append({"name": env_var(WorkerSettings, "worker_id"),
                             "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    # SIGTERM: stop taking work, finish in-flight requests for grace_s, hand the rest back, leave the group.
    pod = _worker_pod(values, math.ceil(s.grace_s) + iv.grace_margin_s, container,
                      [volume_source(values.model.volume, "model", read_only=values.model.volume.kind == "pvc"),
                       {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}, *adapter_vols,
                       *kafka_vols])
    if iv.gpus:
        pod["nodeSelector"] = dict(iv.node_selector)
        pod["tolerations"] = [dict(t) for t in iv.tolerations]
    keda = iv.keda.enabled
    return [_deployment(values, "inference", pod, replicas=None if keda else iv.replicas,
                        # GPUs are usually all taken: replace one worker at a time rather than surge.
                        strategy={"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
                        annotations=scrape_annotations(values, s.metrics_port)),
            pdb(values, "inference")]


def _adapter_volumes(values: Values) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Where a worker reads model versions' adapters from and copies them to: the cache (an emptyDir), and,
    when training's artifact store is a folder on the datasets volume (training.artifact_store empty), that
    volume read-only at the path the versions' adapter_uri names. An object store needs no volume: its
    credentials come from inference.adapter_store_secret."""
    vols = [{"name": "adapters", "emptyDir": {"sizeLimit": values.inference.adapter_cache_size}}]
    mounts = [{"name": "adapters", "mountPath": ADAPTER_CACHE_MOUNT}]
    if values.training.enabled and not values.training.artifact_store:
        vols.append(volume_source(values.datasets, "datasets", read_only=values.datasets.kind == "pvc"))
        mounts.append({"name": "datasets", "mountPath": DATASETS_MOUNT, "readOnly": True})
    return vols, mounts


# --- Qdrant ---------------------------------------------------------------------------------------------
def qdrant_url(values: Values) -> str:
    if not values.qdrant.enabled:
        return values.qdrant.url or ""
    return f"http://{name('qdrant')}.{values.namespace}.svc:{QDRANT_HTTP}"


def qdrant(values: Values) -> list[dict[str, Any]]:
    q = values.qdrant
    if not q.enabled:
        return []
    headless = f"{name('qdrant')}-headless"
    env = [{"name": "QDRANT__SERVICE__HTTP_PORT", "value": str(QDRANT_HTTP)},
           {"name": "QDRANT__SERVICE__GRPC_PORT", "value": str(QDRANT_GRPC)}]
    if q.api_key:
        env.append({"name": "QDRANT__SERVICE__API_KEY", "valueFrom": QDRANT_KEY_REF})
    container: dict[str, Any] = {
        "name": "qdrant", "image": q.image, "imagePullPolicy": values.image_pull_policy, "env": env,
        "ports": [{"name": "http", "containerPort": QDRANT_HTTP}, {"name": "grpc", "containerPort": QDRANT_GRPC},
                  {"name": "p2p", "containerPort": QDRANT_P2P}],
        "readinessProbe": http_probe("/readyz", "http", 5, 3), "livenessProbe": http_probe("/livez", "http", 10, 6),
        "startupProbe": http_probe("/livez", "http", 5, 60),
        "resources": resources(q.resources), "securityContext": container_security(),
        "volumeMounts": [{"name": "storage", "mountPath": "/qdrant/storage"},
                         {"name": "snapshots", "mountPath": "/qdrant/snapshots"}]}
    if q.replicas > 1:
        # Cluster mode: peer 0 starts the cluster, the others join it (as Qdrant's Helm chart does).
        env.append({"name": "QDRANT__CLUSTER__ENABLED", "value": "true"})
        peer = f"{name('qdrant')}-$i.{headless}.{values.namespace}.svc:{QDRANT_P2P}"
        first = peer.replace("$i", "0")
        container["command"] = ["/bin/bash", "-c", (
            'i="${HOSTNAME##*-}"; '
            f'if [ "$i" = 0 ]; then exec ./entrypoint.sh --uri "http://{first}"; '
            f'else exec ./entrypoint.sh --bootstrap "http://{first}" --uri "http://{peer}"; fi')]
    pvc_spec = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": q.storage_size}},
                **({"storageClassName": q.storage_class} if q.storage_class else {})}
    pod = {**pod_spec_common(values), "containers": [container],
           # The official image runs as root unless told otherwise; uid 1000 owns the volume through fsGroup.
           "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                               "seccompProfile": {"type": "RuntimeDefault"}},
           "volumes": [{"name": "snapshots", "emptyDir": {}}]}
    ports = [{"name": "http", "port": QDRANT_HTTP, "targetPort": "http"},
             {"name": "grpc", "port": QDRANT_GRPC, "targetPort": "grpc"}]
    return [
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta(values, name("qdrant"), "qdrant"),
         "spec": {"serviceName": headless, "replicas": q.replicas, "podManagementPolicy": "Parallel",
                  "selector": {"matchLabels": selector("qdrant")},
                  "template": {"metadata": {"labels": labels("qdrant", "qdrant")}, "spec": pod},
                  "volumeClaimTemplates": [{"metadata": {"name": "storage"}, "spec": pvc_spec}]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta(values, name("qdrant"), "qdrant"),
         "spec": {"selector": selector("qdrant"), "ports": ports}},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta(values, headless, "qdrant"),
         "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector("qdrant"),
                  "ports": [*ports, {"name": "p2p", "port": QDRANT_P2P, "targetPort": "p2p"}]}},
        pdb(values, "qdrant"),
    ]


# --- Redis (the response cache) -------------------------------------------------------------------------
def redis_url(values: Values) -> str | None:
    """The streams workers' CHATPIPE_CACHE_URL: the Service of the Redis run here, else ``redis.url`` (None:
    no response cache)."""
    if not values.redis.enabled:
        return values.redis.url or None
    return f"redis://{name('redis')}.{values.namespace}.svc:{REDIS_PORT}/0"


def redis_args(values: Values) -> list[str]:
    """redis-server's flags: a cache only, with the local stack's limits unless the values give others."""
    from infra.settings import StackSettings

    fields = StackSettings.model_fields
    r = values.redis
    return ["--port", str(REDIS_PORT), "--maxmemory", r.maxmemory or fields["redis_maxmemory"].default,
            "--maxmemory-policy", r.maxmemory_policy or fields["redis_maxmemory_policy"].default,
            "--save", "", "--appendonly", "no", "--dir", "/data",
            # No password on the Redis run here: only the streams workers in the namespace use it; a Redis
            # reachable from elsewhere is an external one (redis.url, a password from a Secret).
            "--protected-mode", "no"]


def redis(values: Values) -> list[dict[str, Any]]:
    r = values.redis
    if not r.enabled:
        return []
    # redis-server itself (not the image's entrypoint, which would switch user as root): the pod runs as the
    # image's redis user from the start, its only writable folder an emptyDir (nothing is written there: no
    # snapshots, no append-only file).
    container: dict[str, Any] = {
        "name": "redis", "image": r.image, "imagePullPolicy": values.image_pull_policy,
        "command": ["redis-server"], "args": redis_args(values),
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"exec": {"command": ["sh", "-c", f"redis-cli -p {REDIS_PORT} ping | grep -q PONG"]},
                           "periodSeconds": 5, "failureThreshold": 2, "timeoutSeconds": 3},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10, "failureThreshold": 6,
                          "timeoutSeconds": 3},
        "resources": resources(r.resources),
        "securityContext": {**container_security(), "readOnlyRootFilesystem": True},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}]}
    pod = {**pod_spec_common(values), "containers": [container],
           "securityContext": {"runAsNonRoot": True, "runAsUser": REDIS_UID, "runAsGroup": REDIS_UID,
                               "fsGroup": REDIS_UID, "seccompProfile": {"type": "RuntimeDefault"}},
           "volumes": [{"name": "data", "emptyDir": {}}]}
    return [
        # One pod: a second would be a second, separate cache. A new one is ready before the old goes (its
        # cache starts empty either way: a miss costs GPU time, never an answer).
        _deployment(values, "redis", pod, replicas=1,
                    strategy={"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                    annotations={}),
        {"apiVersion": "v1", "kind": "Service", "metadata": meta(values, name("redis"), "redis"),
         "spec": {"selector": selector("redis"),
                  "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}]}},
    ]


# --- Secrets and volumes --------------------------------------------------------------------------------
def secrets(values: Values) -> tuple[list[dict[str, Any]], list[str]]:
    """(Secrets rendered from the files the values name, lines saying how to create the others)."""
    out, todo = [], []
    keys_file = values.gateway.keys_file
    if keys_file is not None:
        try:
            text = keys_file.read_text(encoding="utf-8")
        except OSError as e:
            raise RenderError(f"gateway.keys_file {keys_file} cannot be read: {e.strerror}") from None
        try:
            json.loads(text)
        except ValueError:
            raise RenderError(f"gateway.keys_file {keys_file} is not JSON (API key -> {{\"tenant\": ...}})") from None
        out.append(_secret(values, GATEWAY_KEYS_SECRET, "gateway", {"keys.json": text}))
    else:
        todo.append(f"kubectl -n {values.namespace} create secret generic {GATEWAY_KEYS_SECRET} "
                    "--from-file=keys.json=PATH   # API keys -> tenants (docs/gateway.md \"Keys\")")
    if values.qdrant.enabled and values.qdrant.api_key:
        key_file = values.qdrant.api_key_file
        if key_file is not None:
            key = (key_file.read_text(encoding="utf-8").splitlines() or [""])[0].strip()
            if not key:
                raise RenderError(f"qdrant.api_key_file {key_file} is empty")
            out.append(_secret(values, QDRANT_SECRET, "qdrant", {QDRANT_SECRET_KEY: key}))
        else:
            todo.append(f"kubectl -n {values.namespace} create secret generic {QDRANT_SECRET} "
                        f"--from-literal={QDRANT_SECRET_KEY}=\"$(openssl rand -hex 32)\"   # Qdrant's API key")
    if values.redis.password_secret:
        todo.append(f"kubectl -n {values.namespace} create secret generic {values.redis.password_secret} "
                    f"--from-literal={values.redis.password_key}=PASSWORD   # the external Redis's AUTH password "
                    "(docs/deploy.md \"Redis\")")
    return out, todo


def _secret(values: Values, secret_name: str, component: str, data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta(values, secret_name, component),
            "type": "Opaque", "stringData": data}


def storage(values: Values) -> list[dict[str, Any]]:
    volumes = ((values.model.volume, "model"), (values.archive, "archive"), (values.datasets, "datasets"))
    if FILES_ENV not in values.gateway.env:  # else the gateways keep files in an object store
        volumes += ((values.files, "files"),)
    return [pvc for volume, what in volumes for pvc in claim(values, volume, what)]


def render(values: Values) -> dict[str, list[dict[str, Any]]]:
    return {"gateway": gateway(values), "streams": streams(values), "inference": inference(values),
            "qdrant": qdrant(values), "redis": redis(values), "storage": [*storage(values), *model_pull_job(values)]}
