"""The seek back after a rebalance covers partitions nobody has committed (streams/faust_runtime/offsets.py).

Real aiokafka consumers on the test broker. aiokafka's own ``seek_to_committed`` leaves a partition
with no committed offset where the fetcher is, so records fetched and dropped before the seek never
come again (two answers never recorded on the scale-out stack); ``seek_to_committed_or_beginning``
reads such a partition from its start and leaves committed ones at their offset.
"""

from __future__ import annotations

import pytest

from streams.faust_runtime.offsets import seek_to_committed_or_beginning

pytestmark = pytest.mark.integration


async def _consumer_past_four_records(kafka_settings, topic_factory, group_id):
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.structs import TopicPartition

    topic = topic_factory(partitions=1)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_settings.bootstrap_servers)
    await producer.start()
    try:
        for i in range(4):
            await producer.send_and_wait(topic, f"record {i}".encode(), partition=0)
    finally:
        await producer.stop()
    tp = TopicPartition(topic, 0)
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka_settings.bootstrap_servers, group_id=group_id,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([tp])
        fetched = []
        for _ in range(30):
            fetched += (await consumer.getmany(tp, timeout_ms=500)).get(tp, [])
            if len(fetched) >= 4:
                break
        assert [m.offset for m in fetched] == [0, 1, 2, 3]
        assert await consumer.position(tp) == 4
    except BaseException:
        await consumer.stop()
        raise
    return consumer, tp


async def _next_offset(consumer, tp) -> int:
    for _ in range(30):
        got = (await consumer.getmany(tp, timeout_ms=500, max_records=1)).get(tp, [])
        if got:
            return got[0].offset
    raise AssertionError("nothing fetched after the seek")


async def test_a_partition_nobody_committed_is_read_again_from_its_start(kafka_settings, topic_factory, group_id):
    consumer, tp = await _consumer_past_four_records(kafka_settings, topic_factory, group_id)
    try:
        assert (await consumer.seek_to_committed()) == {tp: None}
        assert await consumer.position(tp) == 4, "aiokafka's own seek moves nothing (what faust_runtime/offsets.py fixes)"

        committed = await seek_to_committed_or_beginning(consumer)
        assert committed == {tp: None}
        assert await _next_offset(consumer, tp) == 0
    finally:
        await consumer.stop()


async def test_a_committed_partition_goes_back_to_its_offset_and_others_only_when_asked(kafka_settings, topic_factory,
                                                                                        group_id):
    consumer, tp = await _consumer_past_four_records(kafka_settings, topic_factory, group_id)
    try:
        await consumer.commit({tp: 2})
        assert (await seek_to_committed_or_beginning(consumer)) == {tp: 2}
        assert await _next_offset(consumer, tp) == 2
    finally:
        await consumer.stop()

    consumer, tp = await _consumer_past_four_records(kafka_settings, topic_factory, group_id + "-b")
    try:
        await seek_to_committed_or_beginning(consumer, resets=lambda topic: False)  # a changelog: left alone
        assert await consumer.position(tp) == 4
    finally:
        await consumer.stop()


async def test_the_groups_committed_offset_is_asked_through_fausts_own_consumer(kafka_settings, topic_factory,
                                                                               group_id):
    """``group_committed`` reaches the broker through a real Faust consumer's thread (what ``Batches`` asks
    for a partition's first event, before Faust's seek back knows where the group stands)."""
    import faust
    from confluent_kafka import Consumer, TopicPartition

    from streams.faust_runtime.offsets import group_committed

    topic = topic_factory(partitions=2)
    committer = Consumer({"bootstrap.servers": kafka_settings.bootstrap_servers, "group.id": group_id})
    try:
        committer.commit(offsets=[TopicPartition(topic, 0, 3)], asynchronous=False)
    finally:
        committer.close()
    app = faust.App(group_id, broker=f"kafka://{kafka_settings.bootstrap_servers}", autodiscover=False,
                    web_enabled=False)
    thread = app.consumer._thread
    await thread.start()
    try:
        assert await group_committed(app.consumer, (topic, 0)) == 3
        assert await group_committed(app.consumer, (topic, 1)) is None
    finally:
        await thread.stop()


def test_the_seek_is_patched_into_fausts_consumer_thread_once():
    """The monkeypatch lands where faust-streaming 0.15.3 calls it (its recovery's ``perform_seek`` ->
    ``AIOKafkaConsumerThread.seek_to_committed``), and installing twice keeps one patch."""
    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

    from streams.faust_runtime import offsets

    offsets.install()
    patched = AIOKafkaConsumerThread.seek_to_committed
    offsets.install()
    assert AIOKafkaConsumerThread.seek_to_committed is patched and patched.covers_uncommitted


async def test_fausts_consumer_fetches_with_the_configured_wait(kafka_settings, group_id):
    """``fetch_wait.install``: a real Faust consumer's aiokafka fetcher holds fetches for the configured
    time, not Faust's fixed 1500 ms (faust_runtime/fetch_wait.py); installing twice keeps one patch and the
    last value."""
    import faust
    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

    from streams.faust_runtime import fetch_wait

    fetch_wait.install(250)
    patched = AIOKafkaConsumerThread._create_worker_consumer
    fetch_wait.install(100)
    assert AIOKafkaConsumerThread._create_worker_consumer is patched
    app = faust.App(group_id, broker=f"kafka://{kafka_settings.bootstrap_servers}", autodiscover=False,
                    web_enabled=False)
    thread = app.consumer._thread
    await thread.start()
    try:
        assert thread._consumer._fetcher._fetch_max_wait_ms == 100
    finally:
        await thread.stop()
