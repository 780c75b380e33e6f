"""Settings of the Kafka adapters, shared by every component that talks to the broker."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class KafkaSettings(BaseSettings):
    """Where the broker is and how topics are named.

    Built once by the CLI from flags and ``CHATPIPE_*`` environment variables
    (``CHATPIPE_BOOTSTRAP_SERVERS``, ``CHATPIPE_TOPIC_PREFIX``, ...), then passed explicitly.
    """

    model_config = SettingsConfigDict(env_prefix="CHATPIPE_", frozen=True, extra="forbid")

    bootstrap_servers: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers, host:port[,host:port]")
    topic_prefix: str = Field("", description="Put in front of every catalog topic name, e.g. 'staging.'")
    client_id: str = Field("chatpipe", description="Kafka client.id, shows up in broker logs and metrics")
    # Linger, batch and poll sizes are each service's own settings (the worker's chunk_linger_ms and
    # poll_timeout_s, ...): what suits token chunks does not suit an archive batch.
    replication_factor: int = Field(1, ge=1, description="Replication factor of topics created by `topics apply`")
    delivery_timeout_s: float = Field(30.0, gt=0, description="A record the broker has not acknowledged by then "
                                      "fails (the services' producers; the gateway has its own, shorter one)")

    def topic(self, name: str) -> str:
        """The real topic name of catalog topic ``name`` under this deployment's prefix."""
        return f"{self.topic_prefix}{name}"

    def client_config(self) -> dict[str, str | int | float | bool]:
        """librdkafka settings common to producers, consumers and the admin client."""
        return {"bootstrap.servers": self.bootstrap_servers, "client.id": self.client_id}
