"""The services' producer: every send can return an awaitable acknowledgement, "this record is durable".

The inference worker must commit (or ACCEPT) a request only once *its* Response is acknowledged
by the broker, and the gateway answers a request only once its prompt is; waiting for the whole
queue to drain (``flush``) would never end under a steady stream of token chunks. So each
``send`` may get its own delivery callback and an ``asyncio.Future`` resolved on the caller's
event loop.

Delivery reports (``poll``) are served by whoever is active, one at a time (``_poll_lock``): a
sender serves them itself, without waiting, every ``SERVE_EVERY`` sends; a sender on an event loop
then keeps serving them from that loop every ``TAIL_POLL_S`` (1 ms) while records of it are in
flight, so the acknowledgement a task awaits after a burst comes as fast as before; a background
thread serves them whenever no sender has for ``SENDER_SERVES_S``, so the event loop never blocks
on the broker and a sender without a loop gets its reports too (those of a burst's last records at
most ``SENDER_SERVES_S`` late). Why not the thread alone: a report's callback needs the GIL, and a
thread that took it from a busy sender for every report cost a forced switch and two context
switches a record (per-thread CPU in docs/benchmarks.md "bench/kafka_io.py").

Idempotence is on (acks=all, no duplicates from retries, order kept per
partition); ``linger.ms`` is the caller's choice (token chunks are latency-bound, not
throughput-bound). A record the broker has not acknowledged within the delivery timeout
(``KafkaSettings.delivery_timeout_s`` unless the caller gives its own; librdkafka's
``message.timeout.ms``, 300 s by default) fails with :class:`DeliveryError`: a broker that is away
is reported in seconds, not minutes.

Keys are partitioned by Kafka's murmur2 (``partitioner=murmur2_random``, see
:mod:`transport.partitioning`) like Faust and every Java client, never by librdkafka's default
(CRC32); a caller's ``extra_config`` cannot change that.

When librdkafka's local queue is full (the broker has been away a while), a send made on an event
loop does not wait there: the record joins a FIFO of records waiting for room that the loop
retries every few milliseconds, and every later send of that loop joins it too, so the order of
records is kept. Past the delivery timeout every waiting record fails with
:class:`QueueFullError` (its future, or the ``failed`` count). A send from a thread without an
event loop waits for room in place, at most the delivery timeout, then raises ``QueueFullError``.

Every record has a delivery callback, a future or not: ``delivered`` and ``failed`` count every
record, and a failure is logged. It costs about 1 us a record (``bench/kafka_io.py``), nearly all of
it confluent-kafka building the report's ``Message`` (the value copied); librdkafka's
``delivery.report.only.error`` would skip that for successes, but it is per producer, so no
acknowledgement future would ever resolve.

Not here: encoding choices beyond the codec, retries above librdkafka's own, transactions.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from schemas.codec import AvroCodec, default_codec
from transport import tracing
from transport.spans import Tracer
from transport.errors import DeliveryError, QueueFullError
from transport.partitioning import LIBRDKAFKA_PARTITIONER
from transport.settings import KafkaSettings

log = logging.getLogger(__name__)

RETRY_S = 0.005  # how often a full local queue is tried again (the report thread drains it meanwhile)
SERVE_EVERY = 64  # a sender serves the delivery reports itself every this many sends
# The report thread leaves the reports to a sender active this recently (a sender preempted for
# less, as a 2-core machine does for milliseconds at a time, is still the one sending: at 5 ms the
# report thread still cost 2-3 us a record in takeovers), and waits in librdkafka at most this long
# while a sender was active within REPORT_POLL_S, so a sender coming back finds the lock free.
SENDER_SERVES_S = 0.02
REPORT_POLL_S = 0.05  # the report thread's longest wait in librdkafka for a report
TAIL_POLL_S = 0.001  # how often a loop that sent serves the reports while its records are in flight
_time_ns = time.time_ns


@dataclass(slots=True)
class _Waiting:
    """A record that found librdkafka's queue full, waiting on the event loop for room."""

    topic: str
    value: bytes
    key: str | bytes | None
    kwargs: dict[str, Any]
    future: asyncio.Future | None
    since: float  # time.monotonic() of the send


class AckedWriter:
    def __init__(
        self,
        settings: KafkaSettings,
        *,
        codec: AvroCodec | None = None,
        linger_ms: float = 1.0,
        delivery_timeout_s: float | None = None,
        extra_config: dict[str, Any] | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.settings = settings
        # Records a "send <topic>" span per record (transport/spans.py), under this service's name.
        self.tracer = tracer or Tracer(settings.client_id)
        self.codec = codec or default_codec()
        extra = dict(extra_config or {})
        timeout_ms = max(1, round(1000 * (settings.delivery_timeout_s if delivery_timeout_s is None
                                          else delivery_timeout_s)))
        # "delivery.timeout.ms" is librdkafka's alias of "message.timeout.ms" (a caller may give either).
        timeout_ms = int(extra.pop("delivery.timeout.ms", extra.pop("message.timeout.ms", timeout_ms)))
        self.delivery_timeout_s = timeout_ms / 1000
        self._producer = Producer({
            **settings.client_config(),
            "enable.idempotence": True,
            "linger.ms": linger_ms,
            "compression.type": "lz4",
            "message.timeout.ms": timeout_ms,
            **extra,
            # Part of the contract (docs/producing.md "Keys and partitions"): a conversation lands on the
            # partition every other producer and the streams tier's table put it on.
            "partitioner": LIBRDKAFKA_PARTITIONER,
        })
        self.delivered = 0
        self.failed = 0
        self._count_delivery = self._count  # the delivery callback of a record sent without want_ack, bound once
        self._waiting: deque[_Waiting] = deque()
        self._waiting_loop: asyncio.AbstractEventLoop | None = None
        self._sends = 0
        self._served_at = 0.0  # time.monotonic() of a sender's last serving of the reports
        self._tail_loop: asyncio.AbstractEventLoop | None = None  # the loop serving the in-flight tail
        self._poll_lock = threading.Lock()  # one thread serves the reports at a time (the counts, the order)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_reports, name="chatpipe-acks", daemon=True)
        self._thread.start()

    def _serve_reports(self) -> None:
        """The report thread: serves the reports while no sender does."""
        while not self._stop.is_set():
            idle_s = time.monotonic() - self._served_at
            if idle_s < SENDER_SERVES_S:  # a busy sender serves them; look again once it may have stopped
                self._stop.wait(SENDER_SERVES_S - idle_s)
                continue
            with self._poll_lock:
                self._poll(REPORT_POLL_S if idle_s > REPORT_POLL_S else SENDER_SERVES_S)

    def _serve_inline(self) -> None:
        """On the sender's thread, every ``SERVE_EVERY`` sends: the reports waiting now, if no other
        thread is serving them (never waits)."""
        self._served_at = time.monotonic()  # even if the report thread holds the lock: it lets go soon
        self._poll_unless_busy()
        loop = _running_loop()
        if loop is not None and self._tail_loop is not loop:
            self._tail_loop = loop
            loop.call_later(TAIL_POLL_S, self._serve_tail, loop)

    def _serve_tail(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop that sent, every ``TAIL_POLL_S`` while records are in flight (librdkafka's
        count includes reports not yet served): the reports a task of it may be awaiting, without the
        report thread's GIL handoffs. Once none is in flight the report thread takes over at once
        (with the broker away that is the delivery timeout: a poll(0) a millisecond until then)."""
        self._poll_unless_busy()
        if len(self._producer) and not self._stop.is_set():
            self._served_at = time.monotonic()
            loop.call_later(TAIL_POLL_S, self._serve_tail, loop)
        else:
            self._tail_loop = None
            self._served_at = 0.0

    def _poll_unless_busy(self) -> None:
        if self._poll_lock.acquire(blocking=False):
            try:
                self._poll(0)
            finally:
                self._poll_lock.release()

    def _poll(self, timeout_s: float) -> None:
        try:
            self._producer.poll(timeout_s)
        except Exception:  # a callback's error must neither reach an unrelated send nor end the thread
            log.exception("a delivery report's callback failed")

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
        once the broker has it, failing with :class:`DeliveryError` if it does not get there within
        the delivery timeout (:class:`QueueFullError` when it never left this process).

        Without ``want_ack`` (e.g. a token chunk that is not the last) no future is made: the
        records of one partition are delivered in order, so acknowledging the last one is enough.
        Never blocks an event loop; from a thread without one, waits for room in a full queue at
        most the delivery timeout, then raises :class:`QueueFullError`.
        """
        value = self.codec.encode(record)
        if want_ack:
            loop = asyncio.get_running_loop()
            future = loop.create_future()

            def on_delivery(err: KafkaError | None, msg: Message) -> None:
                self._count(err, msg)
                loop.call_soon_threadsafe(_settle, future, err, msg.topic(), msg.partition())
        else:
            future, on_delivery = None, self._count_delivery

        start_ns = _time_ns()
        if headers and tracing.find(headers) is not None:
            # The caller gave the record its context (e.g. a worker's chunks carry their stream's span):
            # the caller records that span, not this send.
            traceparent, all_headers = None, headers
        else:
            traceparent = tracing.child_traceparent(parent_trace) if parent_trace else tracing.new_traceparent()
            own = (tracing.HEADER, traceparent.encode("ascii"))
            all_headers = [*headers, own] if headers else [own]
        if self._waiting and _running_loop() is self._waiting_loop:  # nothing overtakes a waiting record
            self._waiting.append(_Waiting(topic, value, key, _kwargs(all_headers, on_delivery, partition), future,
                                          time.monotonic()))
        else:
            try:
                # Positional partition (-1: librdkafka's "unassigned", what an omitted one is) and no
                # **kwargs dict: ~0.2 us a record less than building and unpacking one.
                self._producer.produce(topic, value, key, -1 if partition is None else partition,
                                       on_delivery=on_delivery, headers=all_headers)
            except BufferError:  # librdkafka's local queue is full
                kwargs = _kwargs(all_headers, on_delivery, partition)
                loop = _running_loop()
                if loop is None:
                    self._produce_when_room(topic, value, key, kwargs)
                else:
                    self._wait_on(loop, _Waiting(topic, value, key, kwargs, future, time.monotonic()))
        if traceparent is not None:
            self.tracer.record_send(topic, traceparent, parent_trace, start_ns, partition)
        self._sends += 1
        if self._sends % SERVE_EVERY == 0:
            self._serve_inline()
        return future

    # -- a full local queue ------------------------------------------------------------------------

    def _produce_when_room(self, topic: str, value: bytes, key: str | bytes | None, kwargs: dict[str, Any]) -> None:
        """Off any event loop: wait here (the report thread drains the queue), at most the delivery timeout."""
        deadline = time.monotonic() + self.delivery_timeout_s
        while True:
            time.sleep(RETRY_S)
            try:
                self._producer.produce(topic, value, key, **kwargs)
                return
            except BufferError:
                if time.monotonic() > deadline:
                    raise QueueFullError(self._queue_full(topic), code=KafkaError._QUEUE_FULL) from None

    def _wait_on(self, loop: asyncio.AbstractEventLoop, item: _Waiting) -> None:
        self._waiting_loop = loop
        self._waiting.append(item)
        if len(self._waiting) == 1:
            loop.call_later(RETRY_S, self._produce_waiting)

    def _produce_waiting(self) -> None:
        """On the event loop: hand the waiting records over in order while there is room."""
        while self._waiting:
            item = self._waiting[0]
            try:
                self._producer.produce(item.topic, item.value, item.key, **item.kwargs)
            except BufferError:
                if time.monotonic() - item.since > self.delivery_timeout_s:
                    self._fail_waiting()
                else:
                    asyncio.get_running_loop().call_later(RETRY_S, self._produce_waiting)
                return
            self._waiting.popleft()

    def _fail_waiting(self) -> None:
        """The oldest waiting record is past the delivery timeout: the broker is away. Every waiting
        record fails (the later ones would follow it, and none may overtake it)."""
        items, self._waiting = list(self._waiting), deque()
        self.failed += len(items)
        log.error("%d record(s) failed: %s", len(items), self._queue_full(items[0].topic))
        for item in items:
            if item.future is not None and not item.future.done():
                item.future.set_exception(QueueFullError(self._queue_full(item.topic), code=KafkaError._QUEUE_FULL))

    def _queue_full(self, topic: str) -> str:
        return (f"{topic}: the producer's local queue stayed full for {self.delivery_timeout_s:g} s; is the "
                f"broker at {self.settings.bootstrap_servers} up?")

    # -- delivery reports and shutdown -------------------------------------------------------------

    def _count(self, err: KafkaError | None, msg: Message) -> None:
        if err is None:
            self.delivered += 1
        else:
            self.failed += 1
            log.error("delivery to %s[%s] failed: %s", msg.topic(), msg.partition(), err.str())

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for every queued record; raises DeliveryError if some are still queued.

        Call it off the event loop (``asyncio.to_thread``): records waiting for room are handed
        over by the loop meanwhile.
        """
        timeout = self.delivery_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        while self._waiting and time.monotonic() < deadline:
            time.sleep(RETRY_S)
        # librdkafka's flush serves the reports too: under the lock, in short steps, so the report
        # thread and a sender take turns with it instead of serving reports at the same time.
        while True:
            with self._poll_lock:
                queued = self._producer.flush(min(REPORT_POLL_S, max(0.0, deadline - time.monotonic())))
            if not queued or time.monotonic() >= deadline:
                break
        remaining = queued + len(self._waiting)
        if remaining:
            raise DeliveryError(f"{remaining} record(s) undelivered after {timeout:g}s "
                                f"(broker {self.settings.bootstrap_servers})")

    def close(self, timeout_s: float | None = None) -> None:
        try:
            self.flush(timeout_s)
        finally:
            self._stop.set()
            self._thread.join()


def _kwargs(headers: list[tuple[str, bytes]], on_delivery: Any, partition: int | None) -> dict[str, Any]:
    """``produce``'s keyword arguments for a record that waits for room in the queue."""
    kwargs: dict[str, Any] = {"headers": headers, "on_delivery": on_delivery}
    if partition is not None:
        kwargs["partition"] = partition
    return kwargs


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _settle(future: asyncio.Future, err: KafkaError | None, topic: str, partition: int) -> None:
    if future.done():
        return
    if err is None:
        future.set_result(None)
    else:
        future.set_exception(DeliveryError(f"{topic}[{partition}]: {err.str()}", code=err.code()))
