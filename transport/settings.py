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
    producer_linger_ms: int = Field(5, ge=0, description="How long the producer waits to fill a batch")
    producer_batch_bytes: int = Field(1_000_000, gt=0, description="Largest producer batch in bytes")
    consumer_batch_size: int = Field(500, gt=0, description="Most messages one consumer poll returns")
    consumer_poll_timeout_s: float = Field(1.0, gt=0, description="How long one poll waits for messages")
    replication_factor: int = Field(1, ge=1, description="Replication factor of topics created by `topics apply`")
    delivery_timeout_s: float = Field(30.0, gt=0, description="flush() gives up after this and raises")

    def topic(self, name: str) -> str:
        """The real topic name of catalog topic ``name`` under this deployment's prefix."""
        return f"{self.topic_prefix}{name}"

    def client_config(self) -> dict[str, str | int | float | bool]:
        """librdkafka settings common to producers, consumers and the admin client."""
        return {"bootstrap.servers": self.bootstrap_servers, "client.id": self.client_id}
