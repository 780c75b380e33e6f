"""The services' producer when the broker is away (transport/acked_writer.py).

No broker at all: the producer points at a port nobody listens on, which is what a client sees
while its broker is down. The ordering of records that waited for room is checked against the
real broker in tests/transport/test_kafka_contracts.py.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from confluent_kafka import KafkaError

from schemas.records import Cancel
from transport.acked_writer import AckedWriter
from transport.errors import DeliveryError, QueueFullError
from transport.settings import KafkaSettings


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # free once the socket is closed: nothing listens there


@pytest.fixture
def away() -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=f"127.0.0.1:{closed_port()}")


def record(i: int) -> Cancel:
    return Cancel(request_id=f"r{i}", conversation_id="c", reason="test")


async def test_a_broker_that_is_away_fails_a_send_within_the_delivery_timeout(away):
    """librdkafka's default message timeout is 300 s: a gateway waiting on it held a backlog slot
    for five minutes before its 503. The producer must give up after its delivery timeout."""
    producer = AckedWriter(away, delivery_timeout_s=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(DeliveryError) as caught:
            await asyncio.wait_for(producer.send("chat.prompts", record(0), key="c"), 15)
        assert time.monotonic() - started < 5
        assert caught.value.code == KafkaError._MSG_TIMED_OUT
    finally:
        producer.close(0.1)


def test_the_delivery_timeout_comes_from_the_settings_unless_given(away):
    """KafkaSettings.delivery_timeout_s is what the services' producers use (it was read by flush only)."""
    producers = [AckedWriter(away.model_copy(update={"delivery_timeout_s": 7.5})),
                 AckedWriter(away, delivery_timeout_s=2),
                 AckedWriter(away, extra_config={"message.timeout.ms": 10_000})]
    try:
        assert [p.delivery_timeout_s for p in producers] == [7.5, 2, 10]
    finally:
        for producer in producers:
            producer.close(0)


async def test_a_full_queue_never_blocks_the_event_loop(away):
    """With librdkafka's local queue full, send() slept on the event loop until there was room: a
    gateway stopped answering anything (health included) for as long as the broker was away. Now
    the loop keeps running, the records wait in order, and all of them fail after the timeout."""
    producer = AckedWriter(away, delivery_timeout_s=1.0, extra_config={"queue.buffering.max.messages": 3})
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticks = asyncio.create_task(ticker())
    try:
        acks = []
        for i in range(40):
            ack = producer.send("chat.prompts", record(i), key="c", want_ack=i % 10 == 9)
            if ack is not None:
                acks.append(ack)
            await asyncio.sleep(0)
        assert len(producer._waiting) > 0, "the queue of 3 should have been full"
        started = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*acks, return_exceptions=True), 15)
        assert time.monotonic() - started < 5
        assert all(isinstance(r, DeliveryError) for r in results), results
        assert any(isinstance(r, QueueFullError) for r in results), results
        deadline = time.monotonic() + 5  # those already in librdkafka's queue time out there
        while producer.failed < 40 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert len(producer._waiting) == 0 and producer.failed == 40 and producer.delivered == 0
    finally:
        stop.set()
        await ticks
        producer.close(0.1)
    assert max(gaps) < 0.25, f"the event loop stalled for {max(gaps):.2f} s"


class _Librdkafka:
    """Stands in for confluent-kafka's Producer: what send hands it, kept."""

    def __init__(self):
        self.produced = []

    def produce(self, *args, **kwargs):
        self.produced.append((args, kwargs))

    def poll(self, timeout=0):
        time.sleep(min(timeout, 0.01))
        return 0

    def flush(self, timeout=0):
        return 0


class _Report:
    def topic(self):
        return "chat.prompts"

    def partition(self):
        return 0


def test_each_record_gets_its_own_traceparent_its_send_span_and_a_delivery_report(away, tmp_path, caplog):
    """What the send path hands librdkafka and the trace store: a child traceparent of its own per
    record (the context of its send span, recorded with the topic and partition), the partition
    (-1: librdkafka's "unassigned"), a delivery callback that counts (and logs) every outcome; a
    record the caller gave a traceparent keeps it and records no send span."""
    from clients.traces import read_span_files
    from transport import spans, tracing

    spans.shutdown()
    spans.configure("unit", spans.TracingSettings(file_dir=tmp_path, export_interval_s=60))
    producer = AckedWriter(away, delivery_timeout_s=1.0)
    fake = _Librdkafka()
    producer._producer = fake
    try:
        parent = tracing.new_traceparent()
        own = [("traceparent", tracing.new_traceparent().encode())]
        producer.send("chat.prompts", record(0), key="c", want_ack=False, parent_trace=parent)
        producer.send("chat.prompts", record(1), key="c", want_ack=False, partition=2, headers=[("x", b"1")])
        producer.send("chat.prompts", record(2), key="c", want_ack=False, headers=own)
        spans.flush()
    finally:
        spans.shutdown()
        producer.close(0.1)
    (a0, k0), (a1, k1), (a2, k2) = fake.produced
    assert a0[0] == "chat.prompts" and a0[2] == "c" and a0[3] == -1 and a1[3] == 2
    tp0, tp1 = (tracing.find(k["headers"]) for k in (k0, k1))
    assert tracing.trace_id(tp0) == tracing.trace_id(parent) and tp0 != parent
    assert tracing.trace_id(tp1) not in (None, tracing.trace_id(parent)), "no parent: a trace of its own"
    assert k1["headers"][0] == ("x", b"1") and k2["headers"] == own
    rows = {r.span_id: r for r in read_span_files(tmp_path)}
    assert set(rows) == {tp0[36:52], tp1[36:52]}, "a send span per record, none for a caller's traceparent"
    assert rows[tp0[36:52]].parent_id == parent[36:52] and rows[tp1[36:52]].parent_id is None
    assert rows[tp1[36:52]].attributes["messaging.destination.partition.id"] == "2"
    assert rows[tp0[36:52]].name == "send chat.prompts" and rows[tp0[36:52]].kind == spans.PRODUCER
    # librdkafka's delivery reports, through the callback each record was produced with
    k0["on_delivery"](None, _Report())
    k1["on_delivery"](KafkaError(KafkaError._MSG_TIMED_OUT), _Report())
    assert producer.delivered == 1 and producer.failed == 1
    assert "delivery to chat.prompts[0] failed" in caplog.text
