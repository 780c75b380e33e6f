"""The services' producer when the broker is away (transport/acked_producer.py).

No broker at all: the producer points at a port nobody listens on, which is what a client sees
while its broker is down. The ordering of records that waited for room is checked against the
real broker in tests/integration/test_kafka_contracts.py.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from confluent_kafka import KafkaError

from schemas.records import Cancel
from transport.acked_producer import AckedProducer
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
    producer = AckedProducer(away, delivery_timeout_s=1.0)
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
    producers = [AckedProducer(away.model_copy(update={"delivery_timeout_s": 7.5})),
                 AckedProducer(away, delivery_timeout_s=2),
                 AckedProducer(away, extra_config={"message.timeout.ms": 10_000})]
    try:
        assert [p.delivery_timeout_s for p in producers] == [7.5, 2, 10]
    finally:
        for producer in producers:
            producer.close(0)


async def test_a_full_queue_never_blocks_the_event_loop(away):
    """With librdkafka's local queue full, send() slept on the event loop until there was room: a
    gateway stopped answering anything (health included) for as long as the broker was away. Now
    the loop keeps running, the records wait in order, and all of them fail after the timeout."""
    producer = AckedProducer(away, delivery_timeout_s=1.0, extra_config={"queue.buffering.max.messages": 3})
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
        assert producer.waiting > 0, "the queue of 3 should have been full"
        started = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*acks, return_exceptions=True), 15)
        assert time.monotonic() - started < 5
        assert all(isinstance(r, DeliveryError) for r in results), results
        assert any(isinstance(r, QueueFullError) for r in results), results
        deadline = time.monotonic() + 5  # those already in librdkafka's queue time out there
        while producer.failed < 40 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert producer.waiting == 0 and producer.failed == 40 and producer.delivered == 0
    finally:
        stop.set()
        await ticks
        producer.close(0.1)
    assert max(gaps) < 0.25, f"the event loop stalled for {max(gaps):.2f} s"
