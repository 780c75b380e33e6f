"""Settings of the local stack (``chatpipe up``): the broker and the services started around it.

The fields in ``PERSISTED_FIELDS`` describe where a running stack listens; ``chatpipe up`` writes
them to ``<state_dir>/stack.json`` so that later commands on the same state folder find it
(``infra.stack_state``). Not here: the settings each service reads itself (``StreamsSettings``,
``WorkerSettings``, ``GatewaySettings``); the stack only passes them flags.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

# Where a running stack listens, kept with its state folder and read back by status/down/up: each
# field -> the kinds of service that use it (a running one, any instance of it, makes a different
# value an error). The worker counts name none: `up` with another count adds or stops instances.
_EVERY_SERVICE = ("kafka", "streams", "inference", "gateway")
PERSISTED_FIELDS: dict[str, tuple[str, ...]] = {
    "host": (*_EVERY_SERVICE, "jaeger", "prometheus", "redis"), "topic_prefix": _EVERY_SERVICE,
    "kafka_port": ("kafka",), "controller_port": ("kafka",), "kafka_heap": ("kafka",), "brokers": ("kafka",),
    "gateway_port": ("gateway",), "worker_metrics_port": ("inference",), "qdrant_url": ("streams",),
    "streams_metrics_port": ("streams",),
    "kafka_security": _EVERY_SERVICE,
    "streams_workers": (), "inference_workers": (), "inference_engine": ("inference",),
    # The observability backends (infra.observability): `up --no-observability` stops them, like a count.
    "observability": (), "otlp_grpc_port": ("jaeger",), "otlp_http_port": ("jaeger",),
    "jaeger_port": ("jaeger",), "jaeger_grpc_port": ("jaeger",), "prometheus_port": ("prometheus",),
    # The response cache's Redis (infra.redis_server): the streams workers' command line carries its URL
    # (--cache-url), so the switch and the port may not change under running workers; `up
    # --no-response-cache` with the workers stopped stops Redis, like a count.
    "response_cache": ("streams",), "redis_port": ("redis", "streams"), "redis_maxmemory": ("redis",),
    "redis_maxmemory_policy": ("redis",),
}


def default_cache_dir() -> Path:
    """~/.cache/chatpipe"""
    return Path.home() / ".cache" / "chatpipe"


class StackSettings(BaseSettings):
    """Where the local broker keeps its data and which ports it takes.

    From CLI flags and ``CHATPIPE_*`` environment variables (``CHATPIPE_STATE_DIR``,
    ``CHATPIPE_KAFKA_PORT``, ...).
    """

    model_config = SettingsConfigDict(env_prefix="CHATPIPE_", frozen=True, extra="ignore", populate_by_name=True)

    state_dir: Path = Field(Path(".chatpipe"), description="Broker data, logs and pid file")
    cache_dir: Path = Field(default_factory=default_cache_dir,
                            description="Kafka jars assembled by mvn, shared by every state folder")
    host: str = Field("127.0.0.1", description="Address the broker listens on (loopback only by default)")
    kafka_port: int = Field(9092, ge=1, le=65535, description="Client (PLAINTEXT) port")
    controller_port: int = Field(9093, ge=1, le=65535, description="KRaft controller port")
    kafka_heap: str = Field("512m", description="Broker JVM heap (-Xmx)")
    brokers: int = Field(1, ge=1, le=9, description="Kafka nodes: 1 = one broker (kafka_port, controller_port); "
                                                    "more = a KRaft cluster, node n on kafka_port + 2(n-1) and the next "
                                                    "port, the catalog replicated 3 ways from 3 nodes (docs/cluster.md)")
    java: str = Field("java", description="Java 17+ executable")
    mvn: str = Field("mvn", description="Maven executable used once to fetch the broker jars")
    gateway_port: int = Field(8000, ge=1, le=65535, description="Gateway HTTP port (OpenAI API, /healthz)")
    # The first port of a range the stack hands its workers (worker n: + n - 1), on by default: not the
    # worker's own CHATPIPE_WORKER_METRICS_PORT / CHATPIPE_STREAMS_METRICS_PORT (one port, 0 = off).
    worker_metrics_port: int = Field(
        9464, ge=1, le=65535, validation_alias=AliasChoices("CHATPIPE_STACK_WORKER_METRICS_PORT"),
        description="Inference worker's /metrics port (worker n: + n - 1)")
    streams_metrics_port: int = Field(
        9474, ge=1, le=65535,
        validation_alias=AliasChoices("CHATPIPE_STACK_STREAMS_METRICS_PORT"),
        description="Streams worker's /metrics port (worker n: + n - 1)")
    topic_prefix: str = Field("", description="Topic name prefix of every service of the stack")
    kafka_security: Literal["plaintext", "sasl_ssl"] = Field(
        "plaintext", description="Client listener of the one-broker stack: plaintext, or sasl_ssl (SCRAM-SHA-512 "
                                 "over TLS; CA, broker certificate and one user per service made under "
                                 "<state>/kafka/security; docs/security_broker.md)")
    qdrant_url: str | None = Field(None, description="Qdrant server URL(s) for the streams worker's memory "
                                                     "(`chatpipe streams --qdrant-url`); empty = Qdrant local "
                                                     "mode in <state>/qdrant")
    streams_workers: int = Field(1, ge=1, le=16, description="Streams worker processes (`streams`, `streams-2`, ...), "
                                                          "one consumer group; more than 1 needs qdrant_url")
    inference_workers: int = Field(1, ge=1, le=16, description="Inference worker processes (`inference`, "
                                                            "`inference-2`, ...), one consumer group; worker n's "
                                                            "/metrics on worker_metrics_port + n - 1")
    inference_engine: Literal["auto", "chatpipe", "vllm"] = Field(
        "auto", description="The inference workers' engine (`chatpipe inference --engine`): chatpipe, vllm (its own "
        "environment: make setup-vllm) or auto (vllm on a CUDA device when its environment is there)")
    # Observability (infra.observability, docs/observability.md): a trace store and a metrics store,
    # built once from the Go module proxy into cache_dir/bin; without them spans go to <state>/traces.
    observability: bool = Field(False, description="Also run Jaeger (trace store + UI, in memory) and Prometheus "
                                                   "(scraping every service's /metrics); built on first use")
    otlp_grpc_port: int = Field(4317, ge=1, le=65535, description="Jaeger's OTLP/gRPC receiver")
    otlp_http_port: int = Field(4318, ge=1, le=65535, description="Jaeger's OTLP/HTTP receiver (the services "
                                                                  "post spans to <it>/v1/traces)")
    jaeger_port: int = Field(16686, ge=1, le=65535, description="Jaeger UI and query HTTP API")
    jaeger_grpc_port: int = Field(16685, ge=1, le=65535, description="Jaeger query gRPC API")
    prometheus_port: int = Field(9090, ge=1, le=65535, description="Prometheus UI and HTTP API")
    scrape_interval_s: float = Field(5.0, gt=0, description="How often Prometheus scrapes each service")
    go: str = Field("go", description="Go executable that builds Jaeger and Prometheus once (1.25+)")
    npm: str = Field("npm", description="npm executable that builds the Jaeger and Prometheus UIs once")
    jaeger_ui_source: Path | None = Field(None, description="A jaeger-ui checkout (tag matching Jaeger) or its "
                                                            "built assets, for the Jaeger UI; none: the query "
                                                            "API only, the UI page is Jaeger's placeholder")
    # The response cache (issue 43, infra.redis_server): a Redis in front of the GPUs, used by the streams
    # workers; only a cache (no persistence), evicting by maxmemory_policy once maxmemory is full.
    response_cache: bool = Field(True, description="Run Redis (the streams workers' response cache) and hand "
                                                   "each streams worker its URL; off: no Redis, no cache")
    redis_port: int = Field(6379, ge=1, le=65535, description="Redis port (the response cache)")
    redis_maxmemory: str = Field("256mb", description="Redis maxmemory: most memory the cache takes (Redis's "
                                                      "notation: 256mb, 2gb)")
    redis_maxmemory_policy: str = Field("allkeys-lru", description="Redis maxmemory-policy: which keys go once "
                                        "maxmemory is reached (allkeys-lru: the least recently used)")
    redis_server: str = Field("redis-server", description="Redis server executable (Debian's redis-server "
                                                          "package) the stack runs")
    start_timeout_s: float = Field(120.0, gt=0, description="How long starting Kafka waits for the broker (every "
                                   "node of a cluster) to answer")
    service_start_timeout_s: float = Field(
        300.0, gt=0, description="How long `up` waits for one service (streams, inference, gateway) to be healthy; "
                                 "the first start loads models on a busy machine")
    stop_timeout_s: float = Field(30.0, gt=0, description="How long `down` waits after SIGTERM before SIGKILL")
    # The supervisor (`infra.supervisor`): a service that exits is started again after a delay that
    # doubles per exit, from restart_backoff_s up to restart_backoff_max_s, and falls back to
    # restart_backoff_s once the service has run restart_backoff_reset_s without exiting.
    restart_backoff_s: float = Field(1.0, gt=0, description="Delay before the first restart of a service that exited")
    restart_backoff_max_s: float = Field(30.0, gt=0, description="Longest delay between restarts")
    restart_backoff_reset_s: float = Field(60.0, gt=0, description="A service that ran this long restarts after "
                                                                   "restart_backoff_s again")

    @field_validator("state_dir")
    @classmethod
    def _state_dir_is_a_folder(cls, value: Path) -> Path:
        # Caught here so a wrong path is one line, not a traceback from deep inside `up`.
        if value.exists() and not value.is_dir():
            raise ValueError(f"{value} is a file, not a folder; choose another --state-dir / CHATPIPE_STATE_DIR")
        return value

    @field_validator("qdrant_url")
    @classmethod
    def _empty_url_is_local_mode(cls, value: str | None) -> str | None:
        # `--qdrant-url ''` takes a stack back to local mode (a saved URL would be used otherwise).
        return (value or "").strip() or None

    @field_validator("kafka_security", mode="before")
    @classmethod
    def _security_any_case(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("kafka_security")
    @classmethod
    def _security_on_one_broker(cls, value: str, info: ValidationInfo) -> str:
        brokers = info.data.get("brokers", 1)  # validated before: declared earlier
        if value != "plaintext" and brokers > 1:
            # A custom error keeps the line as written (a ValueError would read "Value error, ...").
            raise PydanticCustomError("kafka_security", "--kafka-security {value} secures the one-broker stack only, "
                                      "not a {brokers}-node cluster; use --brokers 1",
                                      {"value": value, "brokers": brokers})
        return value

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.kafka_port}"

    @property
    def logs_dir(self) -> Path:
        """``<service>.log`` of every service but Kafka (which keeps its own under kafka/logs)."""
        return self.state_dir.resolve() / "logs"

    @property
    def run_dir(self) -> Path:
        """``<service>.pid`` of every service but Kafka; the supervisor's pid, spec and state files."""
        return self.state_dir.resolve() / "run"

    @property
    def keys_file(self) -> Path:
        return self.state_dir.resolve() / "gateway" / "keys.json"

    @property
    def gateway_url(self) -> str:
        return f"http://{self.host}:{self.gateway_port}"

