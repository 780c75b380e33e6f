"""The broker version choice: Kafka 4.x must serve aiokafka (faust-streaming's client) as well as
confluent-kafka. Kafka 4 removed old protocol versions (KIP-896); this catches a client that
still needs one of them."""

from __future__ import annotations

import pytest

from schemas.codec import default_codec
from tests.samples import sample_records

pytestmark = pytest.mark.integration


async def test_aiokafka_produces_and_consumes_in_a_group(kafka_settings, topic_factory, group_id):
    """Idempotent produce, group join, fetch and offset commit through aiokafka, reading our Avro bytes."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.structs import TopicPartition

    topic = topic_factory(partitions=2)
    records = sample_records()
    producer = AIOKafkaProducer(bootstrap_servers=kafka_settings.bootstrap_servers, enable_idempotence=True)
    await producer.start()
    try:
        for record in records:
            await producer.send_and_wait(topic, default_codec().encode(record), key=b"k")
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(topic, bootstrap_servers=kafka_settings.bootstrap_servers, group_id=group_id,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        got = []
        for _ in range(30):
            batches = await consumer.getmany(timeout_ms=1000)
            got += [m for msgs in batches.values() for m in msgs]
            if len(got) >= len(records):
                break
        await consumer.commit()
        partition = got[0].partition
        committed = await consumer.committed(TopicPartition(topic, partition))
    finally:
        await consumer.stop()
    assert [default_codec().decode(m.value) for m in got] == records  # one key: one partition, in order
    assert committed == len(records)
