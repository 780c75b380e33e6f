"""GroupReader on the test broker: a consumer that is no member of its group raises instead of going deaf.

In a CI run the worker's interactive consumer lost its session in a broker restart and never joined again:
no assignment, no error, its group EMPTY with prompts waiting, the worker heartbeating SERVING for minutes.
That state cannot be made on demand; a consumer whose subscription is dropped is out of its group the same
way (no member id, nothing assigned, polls that return nothing), and is what this test uses."""

from __future__ import annotations

import time
import uuid

import pytest

from transport.errors import TransportError
from transport.group_reader import GroupReader

pytestmark = pytest.mark.integration


def test_a_consumer_out_of_its_group_past_the_budget_raises(kafka_settings, topic_factory):
    topic = topic_factory(partitions=2)
    reader = GroupReader(kafka_settings, group_id=f"membership-{uuid.uuid4().hex[:6]}", topics=[topic],
                         error_budget_s=3.0)
    try:
        deadline = time.monotonic() + 30
        while not reader.assignment:  # joined: a member, with both partitions
            assert time.monotonic() < deadline, "the reader never joined its group"
            reader.poll_messages(10, 0.2)
        members_for = time.monotonic() + 4  # a member polling past the budget is fine
        while time.monotonic() < members_for:
            reader.poll_messages(10, 0.2)
        reader._consumer.unsubscribe()  # out of the group, as after a lost session that never rejoined
        started = time.monotonic()
        with pytest.raises(TransportError, match="not been a member of group"):
            while time.monotonic() - started < 30:
                reader.poll_messages(10, 0.2)
        assert 3.0 <= time.monotonic() - started < 10
    finally:
        reader.close()
