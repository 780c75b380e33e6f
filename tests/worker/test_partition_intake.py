"""The partition intake against the real broker, without an engine: pause/resume across rebalances.

Guards against a partition that stays paused forever after it was revoked while paused and then
assigned back (librdkafka keeps the pause flag across revoke and re-assign; the intake must set
it again), which silently stalls every request on that partition.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from chatpipe.testing.worker import make_request, send_requests
from inference.worker.capacity import Capacity
from inference.worker.intake import Outcome
from inference.worker.intake_partition import PartitionIntake, partition_group_ids
from inference.worker.settings import WorkerSettings
from schemas.codec import default_codec
from transport.group_reader import GroupReader

pytestmark = pytest.mark.integration


async def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_partitions_paused_then_revoked_and_returned_are_served(worker_kafka):
    kafka = worker_kafka
    settings = WorkerSettings(group_id=f"{kafka.topic_prefix}g", max_in_flight=2, poll_timeout_s=0.05)
    capacity = Capacity(2, 1)
    intake = PartitionIntake(kafka, settings, capacity, default_codec())
    taken, revoked, failures = [], [], []
    intake.start(asyncio.get_running_loop(), taken.append, revoked.extend, failures.append)
    try:
        # Fill the two slots: the intake pauses every partition it owns.
        first = [make_request(i, conversation=f"conv-{i}") for i in range(12)]
        send_requests(kafka, first)
        await _wait(lambda: len(taken) == 2, 60, "two requests taken")
        # Another member joins (takes some partitions while they are paused here), then leaves.
        topic = kafka.topic("chat.inference.requests")
        other = GroupReader(kafka, group_id=partition_group_ids(settings)[first[0].priority], topics=[topic],
                              extra_config={"session.timeout.ms": 6000})
        deadline = time.monotonic() + 60
        while not other.assignment and time.monotonic() < deadline:
            await asyncio.to_thread(other.poll_messages, 0, 0.1)  # joined, but takes nothing
        assert other.assignment, "the second member never got a partition"
        # Room again before the partitions come back: the intake resumes what it still owns, and
        # the returned partitions arrive while it has room (no pause call would reset them).
        capacity.max_in_flight = capacity.batch_limit = 100
        capacity.notify()
        await asyncio.sleep(0.5)
        await asyncio.to_thread(other.close)
        # Now free the slots as requests finish: everything must flow, the returned partitions too.
        done = 0
        deadline = time.monotonic() + 120
        while len({item.record.request_id for item in taken} & {r.request_id for r in first}) < len(first):
            assert time.monotonic() < deadline, (f"only {len(taken)} of {len(first)} taken: a partition stalled "
                                                 f"(revoked: {len(revoked)})")
            live = [item for item in taken[done:] if not item.revoked]
            for item in taken[done:]:
                capacity.release(item.priority, started=True)
                intake.finish(item, Outcome.DONE)
            done = len(taken)
            await asyncio.sleep(0.1 if live else 0.05)
    finally:
        intake.stop_taking()
        await asyncio.to_thread(intake.close)


async def test_a_backlog_on_every_partition_is_served_fairly_with_few_slots(worker_kafka):
    """Five requests wait on each of the six partitions and the worker has two slots: the first
    twelve taken must come from every partition. Without the fair window, librdkafka refetches after
    each pause/resume and hands out the lowest partitions first, so partitions 4-5 waited until the
    others were drained (under sustained load: for ever)."""
    from chatpipe.testing.kafka import RecordWriter

    kafka = worker_kafka
    settings = WorkerSettings(group_id=f"{kafka.topic_prefix}fair", max_in_flight=2, poll_timeout_s=0.05)
    capacity = Capacity(2, 1)
    topic = kafka.topic("chat.inference.requests")
    producer = RecordWriter(kafka)
    for partition in range(6):
        for i in range(5):
            producer.send(topic, make_request(partition * 10 + i, conversation=f"conv-{partition}"),
                          key=f"conv-{partition}", partition=partition)
    producer.flush()
    producer.close()
    intake = PartitionIntake(kafka, settings, capacity, default_codec())
    taken, failures = [], []
    intake.start(asyncio.get_running_loop(), taken.append, lambda items: None, failures.append)
    try:
        served = 0
        deadline = time.monotonic() + 120
        while served < 12:
            assert time.monotonic() < deadline, f"only {served} served"
            if len(taken) > served:  # serve one at a time, as a busy worker frees slots
                item = taken[served]
                capacity.release(item.priority, started=True)
                intake.finish(item, Outcome.DONE)
                served += 1
            await asyncio.sleep(0.02)
        partitions = [item.message.partition for item in taken[:12]]
        assert set(partitions) == set(range(6)), f"served in this partition order: {partitions}"
    finally:
        intake.stop_taking()
        await asyncio.to_thread(intake.close)
