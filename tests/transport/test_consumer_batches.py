"""The tests' BatchConsumer (tests/transport/batch_consumer.py) through the real broker: a steady consume loop
must not make the garbage collector promote every batch (the cost that kept it at 0.70 of a raw
loop when it was a transport adapter)."""

from __future__ import annotations

import gc

import pytest

from chatpipe.testing.kafka import RecordWriter
from tests.transport.batch_consumer import BatchConsumer
from schemas import records

pytestmark = pytest.mark.integration


def test_poll_records_loop_starts_no_collection_and_loses_nothing(kafka_settings, topic_factory, group_id):
    """Records built per batch must not start a collection while the caller still holds the previous
    batch (poll_records pauses the collector before its first allocation), and every record comes
    back in order. Fails with one collection per poll if a pause is dropped or starts too late."""
    topic = topic_factory(partitions=1)
    sent = [records.PromptRequest(conversation_id="c", user_id="u", tenant="t", model="m",
                                  messages=[records.ChatMessage("user", f"prompt {i} " + "x" * 200)])
            for i in range(3000)]
    with RecordWriter(kafka_settings) as producer:
        for record in sent:
            producer.send(topic, record, key="c")

    def fail(exc, message):
        raise AssertionError(f"unexpected decode error: {exc}")

    started = []

    def count(phase, info):
        if phase == "start":
            started.append(info["generation"])

    received: list[str] = []
    consumer = BatchConsumer(kafka_settings, group_id=group_id, topics=[topic], on_decode_error=fail)
    gc.callbacks.append(count)
    try:
        polls = 0
        batch = []
        while len(received) < len(sent) and polls < 200:
            batch = consumer.poll_records(records.PromptRequest, max_messages=500, timeout_s=0.5)
            polls += 1
            received.extend([d.record.request_id for d in batch])
            if len(received) <= 1000:  # the first polls may settle the collector's count
                del started[:]
        consumer.commit()
    finally:
        gc.callbacks.remove(count)
        consumer.close()
    assert received == [r.request_id for r in sent]
    assert batch and batch[-1].record == sent[-1]
    # Without the pauses: one collection per poll (at least 4 here); one is tolerated for
    # allocations by other threads of the test process.
    assert len(started) <= 1, started
