"""Where every raw confluent-kafka client of chatpipe is built.

Services use ``transport``'s adapters (``AckedWriter``, ``GroupReader``, ``ShareGroupReader``,
``TailReader``, ``TopicAdmin``); code that needs the raw client (a reader assigning partitions
by hand, a command's one-off producer, a benchmark) gets it here, never from ``confluent_kafka``
directly:

- ``consumer`` / ``producer`` / ``admin`` take ``KafkaSettings``: its ``client_config()`` (the
  bootstrap servers and the security settings: SASL, TLS, OAuth, docs/security.md) comes first,
  the caller's config on top, and librdkafka's global errors (``error_cb``: all brokers down, an
  authentication failure) are logged by their ``transport.failures.classify`` fault, a FATAL one
  as an error, a TRANSIENT one as a warning (librdkafka reconnects by itself).
- ``raw_consumer`` / ``raw_producer`` / ``raw_admin`` take a whole librdkafka config and add
  nothing. They exist for the two callers that must not get chatpipe's settings: ``infra/``,
  which probes and configures the brokers it starts itself (before any ``KafkaSettings`` exists,
  or as the broker's own admin principal), and benchmarks that measure the raw confluent-kafka
  baseline the adapters are compared with (``bench/kafka_io.py``, ``bench/kafka_hop.py``).

``examples/python/`` builds its own clients on purpose: it shows an application team how to
produce to chatpipe with confluent-kafka alone, no chatpipe code.
"""

from __future__ import annotations

import logging
from typing import Any

from confluent_kafka import Consumer, KafkaError, Producer
from confluent_kafka.admin import AdminClient

from transport.failures import Fault, classify
from transport.settings import KafkaSettings

log = logging.getLogger(__name__)


def _log_error(err: KafkaError) -> None:
    level = logging.WARNING if classify(err) is Fault.TRANSIENT else logging.ERROR
    log.log(level, "Kafka client error %s: %s", err.name(), err.str())


def _config(kafka: KafkaSettings, config: dict[str, Any] | None) -> dict[str, Any]:
    return {**kafka.client_config(), "error_cb": _log_error, **(config or {})}


def consumer(kafka: KafkaSettings, group_id: str, config: dict[str, Any] | None = None) -> Consumer:
    """A consumer with ``kafka``'s connection and security settings; ``group_id`` is required by
    librdkafka even when the group is never joined (assign) or committed."""
    return Consumer(_config(kafka, {"group.id": group_id, **(config or {})}))


def producer(kafka: KafkaSettings, config: dict[str, Any] | None = None) -> Producer:
    """A producer with ``kafka``'s connection and security settings."""
    return Producer(_config(kafka, config))


def admin(kafka: KafkaSettings, config: dict[str, Any] | None = None) -> AdminClient:
    """An admin client with ``kafka``'s connection and security settings."""
    return AdminClient(_config(kafka, config))


def raw_consumer(config: dict[str, Any]) -> Consumer:
    """A consumer of exactly ``config`` (see the module docstring for who may)."""
    return Consumer(config)


def raw_producer(config: dict[str, Any]) -> Producer:
    """A producer of exactly ``config`` (see the module docstring for who may)."""
    return Producer(config)


def raw_admin(config: dict[str, Any]) -> AdminClient:
    """An admin client of exactly ``config`` (see the module docstring for who may)."""
    return AdminClient(config)
