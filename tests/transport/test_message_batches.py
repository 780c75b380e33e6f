"""How the consumers build batches: error events are never wrapped, and a batch is built without
starting a garbage collection that would promote the previous batch (transport/batches.py).

The ``Message`` objects are confluent-kafka's own, built the way its tests build them; no broker
is needed to hand them out.
"""

from __future__ import annotations

import gc

import pytest
from confluent_kafka import KafkaError, Message

from transport.batches import pause_gc, resume_gc, wrap_batch
from transport.message import ConsumedMessage


def _messages(n: int, start: int = 0) -> list[Message]:
    return [Message(topic="chat.prompts", partition=i % 6, offset=start + i, key=b"k", value=b"v" * 64,
                    error=None, timestamp=(1, 1_700_000_000_000)) for i in range(n)]


def test_clean_batch_is_wrapped_in_order():
    """Every message of a batch without error events comes back wrapped, in order, nothing dropped."""
    raw = _messages(50)
    batch = wrap_batch(raw)
    assert [type(m) for m in batch] == [ConsumedMessage] * 50
    assert [m.offset for m in batch] == list(range(50))
    assert (batch[7].topic, batch[7].partition, batch[7].value) == ("chat.prompts", 1, b"v" * 64)


def test_batch_with_an_error_event_is_left_to_the_caller():
    """A partition-EOF or broker error among the messages must not be wrapped as data."""
    raw = _messages(10)
    raw.insert(4, Message(topic="chat.prompts", partition=0, error=KafkaError(KafkaError._PARTITION_EOF)))
    assert wrap_batch(raw) is None
    assert wrap_batch([]) == []


def test_pauses_nest_and_restore_the_collector():
    """The collector is off inside (nested) pauses, back on after the last, and stays off if the
    program had turned it off itself."""
    assert gc.isenabled()
    pause_gc()
    pause_gc()
    assert not gc.isenabled()
    resume_gc()
    assert not gc.isenabled()
    resume_gc()
    assert gc.isenabled()
    gc.disable()
    try:
        pause_gc()
        resume_gc()
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.fixture
def collections():
    started = []

    def count(phase, info):
        if phase == "start":
            started.append(info["generation"])

    gc.collect()
    gc.callbacks.append(count)
    yield started
    gc.callbacks.remove(count)


def test_steady_consume_loop_starts_no_collection(collections):
    """A loop that polls 500 messages and drops the previous batch, as a consumer does, must not
    start a collection per poll (which promoted every batch and cost most of the adapter's
    time in bench/kafka_io.py); without the pause this test sees one per poll."""
    batch = wrap_batch(_messages(500))
    batch = wrap_batch(_messages(500, 500))  # the first polls may settle the count
    del collections[:]
    for i in range(2, 12):
        batch = wrap_batch(_messages(500, 500 * i))
    assert len(batch) == 500
    # Without the pause: one collection per poll (10). One or two are tolerated for allocations
    # by other threads of the test process.
    assert len(collections) <= 2, collections
