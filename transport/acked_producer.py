"""A producer whose every send returns an awaitable acknowledgement: "this record is durable".

The inference worker must commit (or ACCEPT) a request only once *its* Response is acknowledged
by the broker. ``RecordProducer.flush()`` waits for everything queued, which under a steady
stream of token chunks may never be empty; here each ``send`` gets its own delivery callback
and an ``asyncio.Future`` resolved on the caller's event loop.

A background thread serves librdkafka's delivery reports (``poll``), so the event loop never
blocks on the broker. Idempotence is on (acks=all, no duplicates from retries, order kept per
partition); ``linger.ms`` is the caller's choice (the worker uses ~0-1 ms: token chunks are
latency-bound, not throughput-bound).

Not here: encoding choices beyond the codec, retries above librdkafka's own, transactions.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from schemas.codec import AvroCodec, default_codec
from transport import tracing
from transport.errors import DeliveryError
from transport.settings import KafkaSettings

log = logging.getLogger(__name__)


class AckedProducer:
    def __init__(
        self,
        settings: KafkaSettings,
        *,
        codec: AvroCodec | None = None,
        linger_ms: float = 1.0,
        extra_config: dict[str, Any] | None = None,
    ) -> None:
        self.settings = settings
        self.codec = codec or default_codec()
        self._producer = Producer({
            **settings.client_config(),
            "enable.idempotence": True,
            "linger.ms": linger_ms,
            "compression.type": "lz4",
            **(extra_config or {}),
        })
        self.delivered = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_reports, name="chatpipe-acks", daemon=True)
        self._thread.start()

    def _serve_reports(self) -> None:
        while not self._stop.is_set():
            self._producer.poll(0.05)

    def send(
        self,
        topic: str,
        record: Any,
        *,
        key: str | bytes | None = None,
        partition: int | None = None,
        headers: list[tuple[str, bytes]] | None = None,
        parent_trace: str | None = None,
        want_ack: bool = True,
    ) -> asyncio.Future | None:
        """Queue ``record``; with ``want_ack`` (called from a coroutine) returns a future resolved
        once the broker has it, failing with :class:`DeliveryError` if librdkafka gives up.

        Without ``want_ack`` (e.g. a token chunk that is not the last) no future is made: the
        records of one partition are delivered in order, so acknowledging the last one is enough.
        """
        value = self.codec.encode(record)
        if want_ack:
            loop = asyncio.get_running_loop()
            future = loop.create_future()

            def on_delivery(err: KafkaError | None, msg: Message) -> None:
                self._count(err, msg)
                loop.call_soon_threadsafe(_settle, future, err, msg.topic(), msg.partition())
        else:
            future, on_delivery = None, self._count

        all_headers = tracing.with_traceparent(headers, parent_trace)
        kwargs: dict[str, Any] = {"headers": all_headers, "on_delivery": on_delivery}
        if partition is not None:
            kwargs["partition"] = partition
        while True:
            try:
                self._producer.produce(topic, value, key, **kwargs)
                break
            except BufferError:  # the local queue is full: the report thread drains it
                time.sleep(0.005)
        return future

    def _count(self, err: KafkaError | None, msg: Message) -> None:
        if err is None:
            self.delivered += 1
        else:
            self.failed += 1
            log.error("delivery to %s[%s] failed: %s", msg.topic(), msg.partition(), err.str())

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for every queued record; raises DeliveryError if some are still queued."""
        timeout = self.settings.delivery_timeout_s if timeout_s is None else timeout_s
        remaining = self._producer.flush(timeout)
        if remaining:
            raise DeliveryError(f"{remaining} record(s) undelivered after {timeout:.0f}s "
                                f"(broker {self.settings.bootstrap_servers})")

    def close(self, timeout_s: float | None = None) -> None:
        try:
            self.flush(timeout_s)
        finally:
            self._stop.set()
            self._thread.join()


def _settle(future: asyncio.Future, err: KafkaError | None, topic: str, partition: int) -> None:
    if future.done():
        return
    if err is None:
        future.set_result(None)
    else:
        future.set_exception(DeliveryError(f"{topic}[{partition}]: {err.str()}"))
