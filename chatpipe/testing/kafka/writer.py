"""A synchronous producer for tests and benches: queue records (or raw bytes), ``flush()``, and
know every one landed.

The services produce with ``transport.acked_writer.AckedWriter`` (a future per record, on
their event loop); a test that sets up its input wants "send these, then be sure" instead.

``enable.idempotence`` gives exactly-once, in-order writes per partition across librdkafka's
retries; keys are partitioned by murmur2 like every producer of the project
(``transport.partitioning``); delivery reports are collected by one callback and ``flush()`` raises
:class:`DeliveryError` if any message failed, so a caller never believes a lost write landed.
Every message gets a W3C ``traceparent`` header (a child of ``parent_trace`` when given).
"""

from __future__ import annotations

import logging
from typing import Any

from confluent_kafka import KafkaError, Message

from schemas.codec import default_codec
from transport import clients
from transport import tracing
from transport.errors import DeliveryError
from transport.partitioning import LIBRDKAFKA_PARTITIONER
from transport.settings import KafkaSettings

log = logging.getLogger(__name__)

Key = str | bytes | None
LINGER_MS = 5  # batches of test input, not latency-bound token chunks


class _DeliveryTracker:
    """Delivery-report sink. Kept apart from RecordWriter so the librdkafka handle holds no
    reference back to it (no cycle): a producer dropped without close() is freed at once."""

    __slots__ = ("failures",)

    def __init__(self) -> None:
        self.failures: list[str] = []

    def __call__(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            self.failures.append(f"{msg.topic()}[{msg.partition()}]: {err.str()}")


class RecordWriter:
    def __init__(self, settings: KafkaSettings, *, extra_config: dict[str, Any] | None = None) -> None:
        self.settings = settings
        self.codec = default_codec()
        self._tracker = _DeliveryTracker()
        config = {
            "enable.idempotence": True,  # implies acks=all and bounded in-flight requests
            "linger.ms": LINGER_MS,
            "compression.type": "lz4",
            "on_delivery": self._tracker,
            **(extra_config or {}),
            # Keys land where the services' producer (AckedWriter) and the streams tier put them.
            "partitioner": LIBRDKAFKA_PARTITIONER,
        }
        self._producer = clients.producer(settings, config)

    def send(self, topic: str, record: Any, *, key: Key = None, headers: tracing.Headers | None = None,
             parent_trace: str | None = None, partition: int | None = None) -> None:
        """Encode ``record`` (Avro single-object) and queue it for ``topic``."""
        self.send_bytes(topic, self.codec.encode(record), key=key, headers=headers,
                        parent_trace=parent_trace, partition=partition)

    def send_bytes(self, topic: str, value: bytes | None, *, key: Key = None, headers: tracing.Headers | None = None,
                   parent_trace: str | None = None, partition: int | None = None) -> None:
        """Queue raw bytes for ``topic``; blocks (serving delivery reports) while the queue is full."""
        headers = tracing.with_traceparent(headers, parent_trace)
        while True:
            try:  # partition -1: librdkafka's "unassigned", the partitioner picks
                self._producer.produce(topic, value, key, partition=-1 if partition is None else partition,
                                       headers=headers)
                break
            except BufferError:
                # librdkafka's local queue is full: let it drain instead of dropping the message.
                self._producer.poll(0.05)
        self._producer.poll(0)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for every queued message; raises :class:`DeliveryError` naming the failures if any
        message was not delivered."""
        timeout = self.settings.delivery_timeout_s if timeout_s is None else timeout_s
        remaining = self._producer.flush(timeout)
        if remaining:
            raise DeliveryError(f"{remaining} message(s) still undelivered after {timeout:.0f}s; "
                                f"is the broker at {self.settings.bootstrap_servers} up?")
        if self._tracker.failures:
            failures, self._tracker.failures = self._tracker.failures, []
            shown = "; ".join(failures[:5])
            raise DeliveryError(f"{len(failures)} message(s) failed delivery: {shown}")

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # don't mask the original error with a flush failure
            try:
                self._producer.flush(self.settings.delivery_timeout_s)
            except Exception:  # the original exception is what matters
                log.exception("flush after error failed")
