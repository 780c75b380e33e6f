"""Errors of the Kafka adapters."""

from schemas.errors import ChatpipeError


class TransportError(ChatpipeError):
    """Kafka said no: a broker unreachable, a fatal client error, a rejected admin call."""


class DeliveryError(TransportError):
    """Messages the producer could not deliver (after librdkafka's own retries).

    ``code``: librdkafka's error code (``confluent_kafka.KafkaError``) when one record's delivery
    report gave it, e.g. ``_MSG_TIMED_OUT`` (the broker is away) or ``_UNKNOWN_PARTITION``.
    """

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class TopicExistsError(TransportError):
    """A topic to be created is already there."""


class QueueFullError(DeliveryError):
    """librdkafka's local queue stayed full for the whole delivery timeout: the broker is away, or
    far slower than the producers. The records were not sent."""
