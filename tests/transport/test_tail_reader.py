"""TailReader on the test broker: a topic of its own deleted is found, whatever its other topics do."""

from __future__ import annotations

import time

import pytest

from chatpipe.testing.kafka import RecordWriter
from transport.errors import TransportError
from transport.tail_reader import TailReader

pytestmark = pytest.mark.integration


def test_a_deleted_topic_stops_the_reader_even_while_its_other_topic_brings_records(kafka_settings, topic_factory):
    """The gateway reads its reply topic and the workers' status topic with one reader. Status reports
    come every two seconds; they used to reset the error budget that the missing reply topic was using
    up, so a gateway whose reply topic was deleted never noticed."""
    from transport import clients

    gone, busy = topic_factory(partitions=1), topic_factory(partitions=1)
    reader = TailReader(kafka_settings, topics=[gone, busy], error_budget_s=2.0, topic_check_s=0.3)
    writer = RecordWriter(kafka_settings)
    admin = clients.admin(kafka_settings)
    try:
        admin.delete_topics([gone])[gone].result(timeout=30)
        started = time.monotonic()
        with pytest.raises(TransportError, match="UNKNOWN_TOPIC_OR_PART"):
            while time.monotonic() - started < 30:
                writer.send_bytes(busy, b"a report", key="w1")
                writer.flush(10)
                reader.poll_messages(10, 0.2)
        assert time.monotonic() - started < 15
    finally:
        reader.close()
