"""Errors of the Kafka adapters."""

from schemas.errors import ChatpipeError


class TransportError(ChatpipeError):
    """Kafka said no: a broker unreachable, a fatal client error, a rejected admin call."""


class DeliveryError(TransportError):
    """Messages the producer could not deliver (after librdkafka's own retries)."""


class TopicExistsError(TransportError):
    """A topic to be created is already there."""
