"""What ``chatpipe k8s render --values FILE`` may change: one typed, frozen object (pydantic).

Everything a service is *configured* with comes from its own settings class (``GatewaySettings``,
``WorkerSettings``, ...; their defaults and ``CHATPIPE_*`` names): a value here either says how
Kubernetes runs it (image, replicas, resources, volumes, node pools, autoscaling bounds) or is passed
to the service as its own variable (``<service>.env``, checked against its settings classes at render
time). A values file is YAML or JSON holding any subset of these fields, nested as here; a field it
does not name keeps its default, an unknown field is an error naming it. ``chatpipe k8s values`` prints
them all with their defaults; docs/deploy.md "Kubernetes" lists them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from schemas.errors import ChatpipeError
from schemas.topics import PROMPTS, spec

#: The gateway's file store (GatewaySettings.files_uri): an object store's URI here replaces the files volume.
FILES_ENV = "CHATPIPE_GATEWAY_FILES_URI"


class ValuesError(ChatpipeError):
    """A values file that cannot be read or does not fit ``Values``."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Resources(_Model):
    requests: dict[str, str] = Field(default_factory=dict, description="cpu, memory, ... the scheduler reserves")
    limits: dict[str, str] = Field(default_factory=dict, description="Most the container may use (memory: "
                                   "killed beyond it)")


def _resources(cpu: str, memory: str, memory_limit: str) -> Any:
    return Field(default_factory=lambda: Resources(requests={"cpu": cpu, "memory": memory},
                                                   limits={"memory": memory_limit}),
                 description="Requests and limits of the container")


class Volume(_Model):
    """A volume several pods share: a PersistentVolumeClaim (made here or existing), a host folder, or an
    emptyDir (each pod its own, gone with the pod)."""

    kind: Literal["pvc", "hostPath", "emptyDir"] = Field("pvc", description="pvc, hostPath or emptyDir")
    claim: str = Field("", description="PersistentVolumeClaim name; empty: chatpipe-<volume>")
    create: bool = Field(True, description="pvc: render the claim (false: it exists already)")
    size: str = Field("20Gi", description="pvc: size asked for")
    storage_class: str | None = Field(None, description="pvc: storageClassName; empty: the cluster's default")
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce", "ReadOnlyMany", "ReadWriteOncePod"] = Field(
        "ReadWriteMany", description="pvc: access mode; pods on several nodes share it only with ReadWriteMany")
    host_path: str | None = Field(None, description="hostPath: the folder on each node")


class KafkaValues(_Model):
    cluster: str = Field("chatpipe-kafka", description="Name of the Strimzi Kafka cluster (its bootstrap Service is "
                         "<cluster>-kafka-bootstrap)")
    version: str = Field("4.3.1", description="Kafka version Strimzi runs (Strimzi 1.2.0 supports 4.2.0-4.3.1; "
                         "share groups need 4.2 or later)")
    metadata_version: str = Field("4.3-IV0", description="KRaft metadata version")
    nodes: int = Field(3, ge=1, description="Broker nodes (with controllers 0 each is broker and controller)")
    controllers: int = Field(0, ge=0, description="Nodes of a separate controller pool; 0: the brokers are "
                             "controllers too (dual role, like `chatpipe cluster`)")
    replication_factor: int | None = Field(None, ge=1, description="Copies of each topic; empty: the catalog's rule "
                                           "(3 from 3 brokers, min.insync.replicas 2; else 1)")
    storage_size: str = Field("100Gi", description="Each node's volume")
    storage_class: str | None = Field(None, description="storageClassName of the nodes' volumes")
    delete_claim: bool = Field(False, description="Delete the nodes' volumes with the cluster")
    resources: Resources = _resources("1", "4Gi", "4Gi")
    config: dict[str, str] = Field(default_factory=dict, description="More broker config (Kafka.spec.kafka.config), "
                                   "over the rendered one")


class GatewayHpa(_Model):
    enabled: bool = Field(True, description="Render a HorizontalPodAutoscaler for the gateway")
    min_replicas: int = Field(2, ge=1, description="Fewest gateways")
    max_replicas: int = Field(10, ge=1, description="Most gateways")
    metric: Literal["cpu", "pending"] = Field(
        "cpu", description="cpu: average CPU use of the requests; pending: chatpipe_gateway_pending per pod "
                           "(requests in flight; needs a custom-metrics adapter such as prometheus-adapter)")
    cpu_percent: int = Field(70, ge=1, le=100, description="cpu: target average CPU use, % of the request")
    pending_per_pod: int | None = Field(None, ge=1, description="pending: target requests in flight per gateway; "
                                        "empty: half of GatewaySettings.max_pending")


class GatewayValues(_Model):
    replicas: int = Field(2, ge=1, description="Gateways when the HPA is off (with it: its starting point)")
    resources: Resources = _resources("500m", "512Mi", "1Gi")
    hpa: GatewayHpa = Field(default_factory=GatewayHpa, description="Its HorizontalPodAutoscaler")
    keys_file: Path | None = Field(None, description="keys.json (API keys -> tenants) to render as the Secret "
                                   "chatpipe-gateway-keys; empty: that Secret is not rendered, create it yourself")
    service_type: Literal["ClusterIP", "LoadBalancer", "NodePort"] = Field("ClusterIP",
                                                                           description="Type of the gateway Service")
    stop_delay_s: int = Field(5, ge=0, description="preStop pause before SIGTERM, while endpoints drop the pod")
    env: dict[str, str] = Field(default_factory=dict, description="More CHATPIPE_* variables (GatewaySettings, "
                                "KafkaSettings, TracingSettings); checked against them")


class StreamsValues(_Model):
    replicas: int = Field(2, ge=1, description="Streams workers: one consumer group, at most the partitions of "
                          "chat.prompts (a further one would own nothing)")
    resources: Resources = _resources("2", "2Gi", "4Gi")
    termination_grace_s: int = Field(45, ge=1, description="SIGTERM to SIGKILL: Faust stops its agents, commits, "
                                     "the archive flushes and the reply producer closes (its own 10 s)")
    env: dict[str, str] = Field(default_factory=dict, description="More CHATPIPE_* variables (StreamsSettings, "
                                "MemorySettings, KafkaSettings, EngineSettings, TracingSettings)")


class InferenceKeda(_Model):
    enabled: bool = Field(True, description="Render a KEDA ScaledObject for the workers (else replicas is fixed)")
    min_replicas: int = Field(1, ge=0, description="Fewest workers (0: none while nothing waits)")
    max_replicas: int = Field(12, ge=1, description="Most workers (partition intake: KEDA stops at the partitions "
                              "of a request topic, 6)")
    lag_per_worker: int | None = Field(None, ge=1, description="Unfinished records per worker the scaler aims at "
                                       "(Kafka scaler: lagThreshold; Prometheus scaler: threshold); empty: 3/4 of the "
                                       "engine's max batch, docs/deploy.md 'Autoscaling'")
    activation_lag: int = Field(0, ge=0, description="Waiting records below which a scaled-to-zero deployment "
                                "stays at zero")
    polling_interval_s: int = Field(15, ge=1, description="How often KEDA asks")
    cooldown_s: int = Field(300, ge=0, description="Quiet time before scaling to zero")
    prometheus_url: str = Field("http://prometheus-operated.monitoring.svc:9090",
                                description="share intake: Prometheus that scrapes the workers' /metrics")


class InferenceValues(_Model):
    intake: Literal["partition", "share"] = Field(
        "share", description="share: share groups (KEDA's Prometheus scaler on the workers' own backlog metric: "
                             "scales on what is unfinished); partition: consumer groups (KEDA's Kafka scaler: the lag "
                             "includes every record behind a running generation, docs/deploy.md 'Autoscaling')")
    max_batch: int | None = Field(None, ge=1, description="Engine max batch (CHATPIPE_MAX_BATCH); empty: 32 on GPU "
                                  "workers (the README 'GPU' runs), the engine's default on CPU")
    replicas: int = Field(1, ge=0, description="Workers when KEDA is off")
    gpus: int = Field(1, ge=0, description="nvidia.com/gpu per worker; 0: CPU workers (no GPU node pool)")
    node_selector: dict[str, str] = Field(default_factory=lambda: {"nvidia.com/gpu.present": "true"},
                                          description="GPU nodes (label set by NVIDIA's GPU feature discovery)")
    tolerations: list[dict[str, Any]] = Field(
        default_factory=lambda: [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        description="Tolerations of the GPU node pool's taints")
    resources: Resources = _resources("4", "16Gi", "32Gi")
    keda: InferenceKeda = Field(default_factory=InferenceKeda, description="Its KEDA ScaledObject")
    grace_margin_s: int = Field(15, ge=0, description="Seconds on top of WorkerSettings.grace_s before SIGKILL: "
                                "hand-back, leaving the group, producer flush, engine stop")
    adapter_cache_size: str = Field("4Gi", description="The emptyDir the workers copy model versions' adapters "
                                    "into (CHATPIPE_WORKER_ADAPTER_CACHE) before loading them")
    adapter_store_secret: str | None = Field(None, description="A Secret whose keys become the workers' environment: "
                                             "the object store's credentials when training.artifact_store is one "
                                             "(e.g. AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY for s3fs)")
    env: dict[str, str] = Field(default_factory=dict, description="More CHATPIPE_* variables (WorkerSettings, "
                                "EngineSettings, KafkaSettings, TracingSettings)")


class ModelValues(_Model):
    mount_path: str = Field("/models", description="Where the model volume is mounted (CHATPIPE_MODEL_CACHE)")
    volume: Volume = Field(default_factory=lambda: Volume(size="20Gi"), description="The volume holding it")
    pull: bool = Field(True, description="An init container runs `chatpipe model pull` into the volume (once: a "
                       "later start finds it there); false: the volume holds the model already")
    path: str | None = Field(None, description="CHATPIPE_MODEL_PATH: a model folder or .gguf inside the volume "
                             "instead of the default model")


class QdrantValues(_Model):
    enabled: bool = Field(True, description="Run Qdrant here (StatefulSet); false: url names a server")
    url: str | None = Field(None, description="Qdrant URL(s) when not run here (CHATPIPE_MEMORY_URL)")
    image: str = Field("qdrant/qdrant:v1.18.0", description="The official image (the version chatpipe is tested "
                       "with, docs/memory.md)")
    replicas: int = Field(1, ge=1, description="Qdrant peers; more than 1 runs Qdrant's cluster mode")
    storage_size: str = Field("10Gi", description="Each peer's volume")
    storage_class: str | None = Field(None, description="storageClassName of the peers' volumes")
    resources: Resources = _resources("500m", "1Gi", "4Gi")
    api_key_file: Path | None = Field(None, description="File whose first line is the API key, rendered as the "
                                      "Secret chatpipe-qdrant; empty: that Secret is not rendered")
    api_key: bool = Field(True, description="Qdrant and the streams workers use the API key of Secret "
                          "chatpipe-qdrant")


class RedisValues(_Model):
    """The streams workers' response cache (CHATPIPE_CACHE_URL, streams/cache_settings.py): a Redis run here,
    or any Redis or Valkey named by ``url``, or none."""

    enabled: bool = Field(True, description="Run Redis here (Deployment + Service; a cache: no volume, no "
                          "persistence); false: url names one (or, empty, no response cache)")
    url: str | None = Field(None, description="When not run here: CHATPIPE_CACHE_URL of the streams workers, "
                            "redis://host:6379/0 or rediss://host:6380/0 (TLS); empty: no response cache")
    password_secret: str | None = Field(None, description="With url: a Secret whose key password_key the streams "
                                        "workers get as CHATPIPE_CACHE_PASSWORD (Redis AUTH); create it yourself")
    password_key: str = Field("password", description="The key of password_secret that holds the password")
    # Redis 7.2: the last Redis line under the BSD licence (7.4 moved to RSALv2/SSPL), with the commands and
    # flags of the 7.0 the local stack runs from Debian (the tests' server); alpine: a small image. Pinned
    # to a patch release so that a render always means the same server.
    image: str = Field("redis:7.2.10-alpine", description="The official Redis image (7.2: the last BSD-licensed "
                       "line, the commands of the local stack's Debian Redis 7.0)")
    maxmemory: str | None = Field(None, description="Redis maxmemory; empty: the local stack's "
                                  "(StackSettings.redis_maxmemory, 256mb). Keep the memory limit above it")
    maxmemory_policy: str | None = Field(None, description="Redis maxmemory-policy; empty: the local stack's "
                                         "(StackSettings.redis_maxmemory_policy, allkeys-lru)")
    resources: Resources = _resources("100m", "320Mi", "512Mi")


class SparkValues(_Model):
    enabled: bool = Field(True, description="Render the Spark jobs")
    schedule_with: Literal["operator", "cronjob"] = Field(
        "operator", description="operator: ScheduledSparkApplication (Spark operator, driver + executors); "
                                "cronjob: a CronJob running `chatpipe job` in one pod (local[*])")
    image: str = Field("chatpipe-spark:0.1.0", description="operator: image of driver and executors, Spark's own "
                       "image with chatpipe installed (docs/deploy.md \"The image\"); the cronjob form runs image")
    schedule: str = Field("0 3 * * *", description="Cron schedule of both jobs")
    source: Literal["kafka", "archive"] = Field("kafka", description="--source of the jobs")
    packages: list[str] | None = Field(None, description="Maven coordinates of the connectors (spark-submit "
                                       "--packages); empty: spark_jobs.jars' connectors for the installed pyspark")
    jars: list[str] = Field(default_factory=list, description="local:// jars instead of packages (no Maven Central "
                            "from the cluster)")
    app_dir: str = Field("/opt/chatpipe", description="Where chatpipe's source is in the Spark image")
    driver_cores: int = Field(1, ge=1, description="operator: the driver pod's cores")
    driver_memory: str = Field("2g", description="operator: the driver's memory (Spark's notation)")
    executor_instances: int = Field(2, ge=1, description="operator: executors per run")
    executor_cores: int = Field(1, ge=1, description="operator: cores per executor")
    executor_memory: str = Field("2g", description="operator: memory per executor")
    cronjob_resources: Resources = Field(
        default_factory=lambda: Resources(requests={"cpu": "2", "memory": "4Gi"}, limits={"memory": "6Gi"}),
        description="cronjob: requests and limits of the job's one pod")


class TrainingValues(_Model):
    """The LoRA training run (k8s/training.py): a SparkApplication of the Spark operator, started by hand."""

    enabled: bool = Field(True, description="Render train-run.yaml (needs spark.enabled and the operator)")
    processes: int = Field(2, ge=1, description="Training processes: one executor each (DDP over gloo)")
    executor_cores: int = Field(2, ge=1, description="Cores of each executor: its process's torch threads")
    executor_memory: str = Field("4g", description="Memory of each executor (the base model and its adapter)")
    tenant: str | None = Field(None, description="CHATPIPE_TRAIN_TENANT: train this tenant's adapter")
    shared_data: bool = Field(False, description="CHATPIPE_TRAIN_SHARED_DATA: the data is declared shared")
    model_name: str = Field("", description="CHATPIPE_TRAIN_MODEL_NAME; empty: <tenant>-lora")
    artifact_store: str = Field("", description="Where versions' artifacts go (an fsspec URI, e.g. s3://bucket/models); "
                                "empty: a folder on the datasets volume")
    env: dict[str, str] = Field(default_factory=dict, description="More CHATPIPE_TRAIN_* (or the store's credential) "
                                "variables")


class PrometheusValues(_Model):
    annotations: bool = Field(True, description="prometheus.io/scrape, port and path annotations on every pod")


class Values(_Model):
    namespace: str = Field("chatpipe", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                           description="Namespace of everything (also in the DNS names the services are given: "
                                       "change it here, not with kustomize)")
    image: str = Field("chatpipe:0.1.0", description="Image with chatpipe installed (`chatpipe` on PATH)")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent",
                                                                         description="imagePullPolicy of every container")
    image_pull_secrets: list[str] = Field(default_factory=list, description="Secrets to pull the image with")
    topic_prefix: str = Field("", description="CHATPIPE_TOPIC_PREFIX: in front of every topic and the streams "
                              "app id")
    security: bool = Field(False, description="Kafka over TLS with SCRAM-SHA-512, one KafkaUser per service with "
                           "its ACLs (infra/kafka_security.py), simple authorization")
    kafka: KafkaValues = Field(default_factory=KafkaValues, description="The Strimzi Kafka cluster")
    gateway: GatewayValues = Field(default_factory=GatewayValues, description="The gateways (Deployment, Service, HPA)")
    streams: StreamsValues = Field(default_factory=StreamsValues, description="The streams workers (Deployment)")
    inference: InferenceValues = Field(default_factory=InferenceValues,
                                       description="The inference workers (Deployment on the GPU pool, KEDA)")
    model: ModelValues = Field(default_factory=ModelValues, description="The chat model's volume (workers; the "
                               "streams tier reads its tokenizer)")
    qdrant: QdrantValues = Field(default_factory=QdrantValues, description="Conversation memory (StatefulSet)")
    redis: RedisValues = Field(default_factory=RedisValues, description="The streams workers' response cache "
                               "(Deployment + Service, or an external Redis / Valkey)")
    archive: Volume = Field(default_factory=lambda: Volume(size="50Gi"),
                            description="The Avro archive the streams workers write and the jobs read")
    datasets: Volume = Field(default_factory=lambda: Volume(size="50Gi"),
                             description="Where the jobs write datasets and reports (DatasetStoreSettings.root)")
    files: Volume = Field(default_factory=lambda: Volume(size="20Gi"),
                          description="The Files API's store (GatewaySettings.files_uri), mounted by every gateway "
                                      "replica; unused when gateway.env sets CHATPIPE_GATEWAY_FILES_URI (an object store)")
    spark: SparkValues = Field(default_factory=SparkValues, description="The batch jobs")
    training: TrainingValues = Field(default_factory=TrainingValues, description="The LoRA training run "
                                     "(train-run.yaml, applied by hand)")
    prometheus: PrometheusValues = Field(default_factory=PrometheusValues, description="Scraping")
    otlp_endpoint: str | None = Field(None, description="CHATPIPE_TRACING_OTLP_ENDPOINT of every service (an "
                                      "OpenTelemetry Collector, Jaeger)")

    @model_validator(mode="after")
    def _check(self) -> "Values":
        partitions = spec(PROMPTS).partitions
        if self.streams.replicas > partitions:
            raise ValueError(f"streams.replicas {self.streams.replicas}: {PROMPTS} has {partitions} partitions, a "
                             f"streams worker beyond {partitions} would own nothing")
        if not self.qdrant.enabled and not self.qdrant.url:
            raise ValueError("qdrant.enabled is false: give qdrant.url (the Qdrant server the streams workers use)")
        several_gateways = self.gateway.replicas > 1 or self.gateway.hpa.enabled
        if several_gateways and self.files.kind == "emptyDir" and FILES_ENV not in self.gateway.env:
            raise ValueError("files.kind emptyDir with several gateway replicas: a file uploaded to one would not be "
                             "there for the others; use a ReadWriteMany pvc or an object store "
                             f"(gateway.env {FILES_ENV})")
        if self.streams.replicas > 1 and self.archive.kind == "emptyDir":
            raise ValueError("archive.kind emptyDir with several streams workers: each would keep part of the "
                             "archive in its own pod; use a ReadWriteMany pvc")
        r = self.redis
        if r.enabled and (r.url or r.password_secret):
            raise ValueError("redis.enabled is true: Redis runs here without a password; redis.url and "
                             "redis.password_secret are for an external one (set redis.enabled false)")
        if r.url and not r.url.startswith(("redis://", "rediss://")):
            raise ValueError(f"redis.url {r.url!r}: a redis:// or rediss:// (TLS) URL")
        if r.password_secret and not r.url:
            raise ValueError("redis.password_secret needs redis.url (the Redis it is the password of)")
        for key, scaler in (("inference.keda", self.inference.keda), ("gateway.hpa", self.gateway.hpa)):
            if scaler.min_replicas > scaler.max_replicas:
                raise ValueError(f"{key}.min_replicas is above max_replicas")
        return self


def load(path: Path | None) -> Values:
    """``Values`` from a YAML or JSON file (None: the defaults); an error names the file and the field."""
    if path is None:
        return Values()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValuesError(f"cannot read values file {path}: {exc.strerror or exc}") from None
    try:
        import yaml

        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except Exception as exc:  # noqa: BLE001 - yaml and json errors alike: one line naming the file
        raise ValuesError(f"values file {path} is not valid {'JSON' if str(path).endswith('.json') else 'YAML'}: "
                          f"{str(exc).splitlines()[0]}") from None
    if data is not None and not isinstance(data, dict):  # None: an empty file, the defaults
        raise ValuesError(f"values file {path} must hold a mapping of fields, not a {type(data).__name__}")
    try:
        values = Values.model_validate(data or {})
    except ValidationError as exc:
        problems = "; ".join(e["msg"].removeprefix("Value error, ") if not e["loc"]
                             else f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValuesError(f"values file {path}: {problems}") from None
    return _relative_to(values, Path(path).parent)


def _relative_to(values: Values, base: Path) -> Values:
    """Files named in a values file are relative to that file's folder."""
    def fix(p: Path | None) -> Path | None:
        return p if p is None or p.is_absolute() else base / p

    return values.model_copy(update={
        "gateway": values.gateway.model_copy(update={"keys_file": fix(values.gateway.keys_file)}),
        "qdrant": values.qdrant.model_copy(update={"api_key_file": fix(values.qdrant.api_key_file)}),
    })


def described(value: BaseModel | None = None, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted name, default, description) of every value, nested models flattened (for docs and
    ``chatpipe k8s values``); a nested model has its own row with default None."""
    value = Values() if value is None else value
    plain = value.model_dump(mode="json")  # each default as JSON has it (a path as text, a model as a dict)
    rows = []
    for name, field in type(value).model_fields.items():
        current = getattr(value, name)
        if isinstance(current, BaseModel) and not isinstance(current, Resources):
            rows.append((f"{prefix}{name}", None, field.description or ""))
            rows += described(current, f"{prefix}{name}.")
        else:
            rows.append((f"{prefix}{name}", plain[name], field.description or ""))
    return rows
