"""Faults of the worker's own parts, and share mode's give-up path, against real worker processes.

Guards against a worker whose intake thread died (a fatal consumer error) while it went on
heartbeating SERVING with /metrics up and nothing exiting, and against a share record rejected
after too many deliveries whose asker never heard of it.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from confluent_kafka import Consumer, TopicPartition

from chatpipe.testing.worker import REPLIES, make_request, send_requests, start_worker
from inference.worker.intake_share import share_group_config, share_group_ids
from inference.worker.settings import WorkerSettings
from schemas.records import FinishReason, Priority, WorkerState
from transport.admin import TopicAdmin
from transport.share_reader import RELEASE, ShareGroupReader

pytestmark = [pytest.mark.integration, pytest.mark.model]


class RangeMember:
    """A classic consumer-group member with the range assignor, polling in a thread: a worker
    (cooperative-sticky) joining the same group is refused with INCONSISTENT_GROUP_PROTOCOL, a
    fatal error of its consumer."""

    def __init__(self, kafka, group_id: str, topic: str) -> None:
        self._consumer = Consumer({**kafka.client_config(), "group.id": group_id, "session.timeout.ms": 6000,
                                   "partition.assignment.strategy": "range"})
        self._consumer.subscribe([topic])
        deadline = time.monotonic() + 30
        while not self._consumer.assignment():  # one thread at a time on the consumer
            assert time.monotonic() < deadline, "the range member never joined"
            self._consumer.poll(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)  # stays a member meanwhile
        self._thread.start()

    def _spin(self) -> None:
        while not self._stop.is_set():
            self._consumer.poll(0.1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._consumer.close()


def _occupy_share_group_id(kafka, group_id: str, topic: str) -> None:
    """Make ``group_id`` a consumer group (one committed offset): Kafka then refuses a share group of
    that id (GROUP_ID_NOT_FOUND on the share heartbeat, a fatal error of the share consumer)."""
    consumer = Consumer({**kafka.client_config(), "group.id": group_id})
    consumer.commit(offsets=[TopicPartition(topic, 0, 0)], asynchronous=False)
    consumer.close()


@pytest.mark.parametrize("intake", ["partition", "share"])
def test_a_dead_intake_thread_stops_the_worker(intake, worker_kafka, reader, tmp_path):
    kafka = worker_kafka
    topic = kafka.topic("chat.inference.requests")
    group = f"{kafka.topic_prefix}workers"  # start_worker's default group
    blocker = None
    if intake == "partition":
        blocker = RangeMember(kafka, group, topic)
    else:
        _occupy_share_group_id(kafka, share_group_ids(WorkerSettings(group_id=group))[Priority.INTERACTIVE], topic)
    worker = start_worker(kafka, tmp_path, intake=intake, worker_id=f"doomed-{intake}")
    try:
        code = worker.proc.wait(120)
        log = worker.log()
        assert code == 1, f"exit code {code}:\n{log[-3000:]}"
        assert "intake thread died" in log, log[-3000:]
        reader.wait_for(lambda s: any(st.worker_id == worker.worker_id for st in s.statuses), 30, "a heartbeat")
        last = [st for st in reader.seen.statuses if st.worker_id == worker.worker_id][-1]
        assert last.state is not WorkerState.SERVING, "the last heartbeat of a dead worker says SERVING"
    finally:
        worker.kill()
        if blocker is not None:
            blocker.close()


def test_a_record_rejected_after_too_many_deliveries_gets_a_final_chunk_and_a_response(worker_kafka, reader, tmp_path):
    """Guards against a share record that is REJECTed after too many deliveries with only a dead
    letter: its client waited for a 504 instead of hearing why."""
    kafka = worker_kafka
    settings = WorkerSettings(group_id=f"{kafka.topic_prefix}workers", max_delivery_attempts=1)
    group = share_group_ids(settings)[Priority.INTERACTIVE]
    TopicAdmin(kafka).set_share_group_config(group, share_group_config(settings))
    req = make_request(1, reply_to=kafka.topic(REPLIES), reply_partition=4)
    send_requests(kafka, [req])
    # One delivery handed back (a worker that gave it up): the next acquisition is delivery 2.
    member = ShareGroupReader(kafka, group_id=group, topics=[kafka.topic("chat.inference.requests")])
    deadline = time.monotonic() + 60
    released = False
    while not released:
        assert time.monotonic() < deadline, "the share consumer never got the record"
        for message in member.poll_messages(0.5):
            member.acknowledge(message, RELEASE)
            released = True
    member.commit(asynchronous=False)
    member.close()
    worker = start_worker(kafka, tmp_path, intake="share", worker_id="strict", CHATPIPE_WORKER_MAX_DELIVERY_ATTEMPTS="1")
    try:
        reader.wait_responses([req.request_id], 120)
        response = reader.seen.first_response(req.request_id)[0]
        assert response.finish_reason is FinishReason.ERROR and "TooManyDeliveriesError" in response.error
        assert "delivered 2 times (limit 1)" in response.error
        reader.wait_for(lambda s: req.request_id in s.final_chunks, 30, "the final chunk")
        chunk = reader.seen.final_chunks[req.request_id][0]
        assert chunk.error_code == "too_many_deliveries" and "delivered 2 times" in chunk.error
        reader.wait_for(lambda s: any(d.error_type == "TooManyDeliveriesError" for d in s.dead_letters), 30,
                        "the dead letter")
        letter = next(d for d in reader.seen.dead_letters if d.error_type == "TooManyDeliveriesError")
        assert {h.key: h.value for h in letter.headers}.get("chatpipe-delivery-count") == b"2"
        assert worker.terminate() == 0, worker.log()[-3000:]
    finally:
        worker.kill()


def test_a_record_that_crashes_the_worker_is_dead_lettered_after_max_record_crashes(worker_kafka, reader, tmp_path):
    """Guards against a poison record crash-looping its partition forever: a request whose handling raises
    a bug (the fault drill's RuntimeError) stops the worker unacked, its restarted self crashes on it again,
    and after ``max_record_crashes`` crashes the next worker dead-letters it with the crash's reason and
    serves the rest. The requests in flight beside it are answered (handed back uncounted, not blamed).
    Restarts are this test's (a supervisor's job); the count lives in the partition's commit metadata."""
    kafka = worker_kafka
    marker = f"crash-drill-{uuid.uuid4().hex[:6]}"
    # One conversation: the same partition, in this order, so the neighbours are in flight with the poison.
    before = make_request(1, conversation="poisoned", reply_to=kafka.topic(REPLIES))
    poison = make_request(2, conversation="poisoned", reply_to=kafka.topic(REPLIES), text=marker)
    after = make_request(3, conversation="poisoned", reply_to=kafka.topic(REPLIES))
    send_requests(kafka, [before, poison, after])
    env = {"CHATPIPE_WORKER_DRILL_CRASH_ON": marker, "CHATPIPE_WORKER_MAX_RECORD_CRASHES": "2"}
    for crash in (1, 2):
        worker = start_worker(kafka, tmp_path, worker_id=f"crashing-{crash}", **env)
        try:
            code = worker.proc.wait(180)
            log = worker.log()
            assert code == 1, f"crash {crash}: exit code {code}:\n{log[-3000:]}"
            assert f"made the worker crash ({crash} of 2" in log, log[-3000:]
        finally:
            worker.kill()
    worker = start_worker(kafka, tmp_path, worker_id="survivor", **env)
    try:
        reader.wait_responses([before.request_id, poison.request_id, after.request_id], 180)
        response = reader.seen.first_response(poison.request_id)[0]
        assert response.finish_reason is FinishReason.ERROR and "PoisonRecordError" in response.error, response
        assert "crash 2 times (limit 2)" in response.error and "RuntimeError: fault drill" in response.error
        for neighbour in (before, after):
            assert reader.seen.first_response(neighbour.request_id)[0].finish_reason is not FinishReason.ERROR
        reader.wait_for(lambda s: poison.request_id in s.final_chunks, 30, "the poison's final chunk")
        assert reader.seen.final_chunks[poison.request_id][0].error_code == "poison_record"
        reader.wait_for(lambda s: any(d.error_type == "PoisonRecordError" for d in s.dead_letters), 30, "the dead letter")
        letter = next(d for d in reader.seen.dead_letters if d.error_type == "PoisonRecordError")
        assert "RuntimeError: fault drill" in letter.error_message
        assert worker.terminate() == 0, worker.log()[-3000:]
    finally:
        worker.kill()
