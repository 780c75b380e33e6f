"""Settings of the local single-node Kafka stack (``chatpipe up``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_cache() -> Path:
    return Path.home() / ".cache" / "chatpipe"


class StackSettings(BaseSettings):
    """Where the local broker keeps its data and which ports it takes.

    From CLI flags and ``CHATPIPE_*`` environment variables (``CHATPIPE_STATE_DIR``,
    ``CHATPIPE_KAFKA_PORT``, ...).
    """

    model_config = SettingsConfigDict(env_prefix="CHATPIPE_", frozen=True, extra="ignore")

    state_dir: Path = Field(Path(".chatpipe"), description="Broker data, logs and pid file")
    cache_dir: Path = Field(default_factory=_default_cache,
                            description="Kafka jars assembled by mvn, shared by every state folder")
    host: str = Field("127.0.0.1", description="Address the broker listens on (loopback only by default)")
    kafka_port: int = Field(9092, ge=1, le=65535, description="Client (PLAINTEXT) port")
    controller_port: int = Field(9093, ge=1, le=65535, description="KRaft controller port")
    kafka_heap: str = Field("512m", description="Broker JVM heap (-Xmx)")
    java: str = Field("java", description="Java 17+ executable")
    mvn: str = Field("mvn", description="Maven executable used once to fetch the broker jars")
    start_timeout_s: float = Field(90.0, gt=0, description="How long `up` waits for the broker to answer")
    stop_timeout_s: float = Field(30.0, gt=0, description="How long `down` waits after SIGTERM before SIGKILL")

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.kafka_port}"

    @property
    def kafka_dir(self) -> Path:
        return self.state_dir.resolve() / "kafka"
