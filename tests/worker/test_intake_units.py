"""The intakes' bookkeeping and thread failures, without a broker: fake consumers, a fake loop.

Each test names the bug it guards against; the rebalance hooks and finishes are called in the
order librdkafka and the worker would call them.
"""

from __future__ import annotations

import threading

import pytest

from chatpipe.testing.worker import make_request
from inference.worker.cancels import CancelListener
from inference.worker.capacity import Capacity
from inference.worker.deletions import DeletionListener
from inference.worker.intake import Outcome
from inference.worker.intake_partition import PartitionIntake, partition_group_ids
from inference.worker.intake_share import share_group_ids
from inference.worker.settings import WorkerSettings
from schemas.codec import default_codec
from schemas.records import Priority
from transport.errors import TransportError
from transport.settings import KafkaSettings
from tests.worker.test_offsets_and_capacity import uncommitted

KAFKA = KafkaSettings(bootstrap_servers="127.0.0.1:9", topic_prefix="u.")
TOPIC = KAFKA.topic("chat.inference.requests")
P = (TOPIC, 0)


class FakeLoop:
    """Runs what the intake hands to the event loop at once, on the calling thread."""

    def call_soon_threadsafe(self, fn, *args):
        fn(*args)


class FakeMessage:
    def __init__(self, offset: int, value: bytes, partition: int = 0) -> None:
        self.topic, self.partition, self.offset, self.value = TOPIC, partition, offset, value
        self.key, self.headers, self.traceparent = b"c1", [], None


class FakeGroupReader:
    """The group's committed offsets with their metadata, kept here as the broker keeps them."""

    def __init__(self) -> None:
        self.topics = [TOPIC]
        self.assignment: set = set()
        self.commits: list[tuple[dict, bool]] = []
        self.metadata: dict = {}  # (topic, partition) -> the last committed metadata string

    def commit_offsets(self, offsets, *, asynchronous=True, metadata=None):
        if offsets:
            self.commits.append((dict(offsets), asynchronous))
            self.metadata.update({tp: (metadata or {}).get(tp, "") for tp in offsets})

    def committed_metadata(self, partition):
        return self.metadata.get(partition, "")


@pytest.fixture
def intake():
    codec = default_codec()
    intake = PartitionIntake(KAFKA, WorkerSettings(group_id="g"), Capacity(4, 3), codec)
    intake._loop = FakeLoop()
    intake.taken, intake.failures = [], []
    intake._dispatch, intake._revoked_cb, intake._failed_cb = intake.taken.append, lambda items: None, intake.failures.append
    intake._consumers = {Priority.INTERACTIVE: FakeGroupReader()}
    intake.value = codec.encode(make_request(1))
    return intake


def _take(intake, offset):
    intake._take(FakeMessage(offset, intake.value), Priority.INTERACTIVE)
    return intake.taken[-1]


def test_an_old_finish_does_not_remove_the_item_that_re_took_its_offset(intake):
    """Guards against a partition whose commit position never moves again: the partition is revoked
    and assigned back, offset 5 is read again (item B) before the old item A's finish is applied;
    A's finish used to pop the entry by (topic, partition, offset), i.e. B's, so B's own finish was
    dropped and the position stayed at 5 for good (every later answer served again after a restart)."""
    intake._on_assign([P])
    a = _take(intake, 5)
    intake._on_revoke([P])
    assert a.revoked
    intake._on_assign([P])
    b = _take(intake, 5)
    intake.finish(a, Outcome.HAND_BACK)  # the worker stops the revoked item and hands it back
    intake._apply_finished()
    intake.finish(b, Outcome.DONE)
    intake._apply_finished()
    assert intake.tracker.position(P) == 6


def test_a_failed_async_commit_is_sent_again(intake):
    """Guards against a commit that the broker refused being counted as done (the position stayed
    uncommitted until some later finish moved it, or for ever on a quiet partition)."""
    consumer = intake._consumers[Priority.INTERACTIVE]
    intake._on_assign([P])
    intake.finish(_take(intake, 5), Outcome.DONE)
    intake._apply_finished()
    intake._commit_finished()
    assert consumer.commits == [({P: 6}, True)]
    intake._commit_finished()
    assert len(consumer.commits) == 1  # in flight: not sent again
    intake._on_commit({}, {P: 6})  # the broker's answer, inside a later poll: failed
    intake._commit_finished()
    assert consumer.commits[-1] == ({P: 6}, True) and len(consumer.commits) == 2
    intake._on_commit({P: 6}, {})
    intake._commit_finished()
    assert len(consumer.commits) == 2 and uncommitted(intake.tracker) == {}


def test_a_record_that_crashed_the_worker_too_often_is_taken_as_a_poison_record(intake):
    """Guards against a record that crashes the worker on every delivery crash-looping its partition: each
    crash is saved at once with the partition's committed position (a synchronous commit, the position
    unchanged), survives the next owner's start (read with the offset), and the record taken with
    max_record_crashes (3) behind it carries PoisonRecordError (answered as a record fault, committed)."""
    consumer = intake._consumers[Priority.INTERACTIVE]
    intake._on_assign([P])
    for crash in range(1, 4):
        neighbour, poison = _take(intake, 5), _take(intake, 6)
        assert poison.error is None
        intake.record_crash(poison, "RuntimeError: boom")
        intake.finish(poison, Outcome.HAND_BACK)
        intake.finish(neighbour, Outcome.HAND_BACK)  # in flight beside it: handed back, not blamed
        intake._apply_crashes()
        intake._apply_finished()
        assert consumer.commits[-1] == ({P: 5}, False)  # the position stays: nothing is skipped
        intake._on_revoke([P])  # the worker stops; its restarted self (or another) is assigned the partition
        intake._on_assign([P])
        assert intake.crashes.get(P, 6) is None and intake.crashes.get(P, 5) is None  # read again from the broker
    again = _take(intake, 5)
    poison = _take(intake, 6)
    assert again.error is None
    assert type(poison.error).__name__ == "PoisonRecordError"
    assert "crash 3 times (limit 3)" in str(poison.error) and "RuntimeError: boom" in str(poison.error)
    intake.finish(again, Outcome.DONE)
    intake.finish(poison, Outcome.DEAD)
    intake._apply_finished()
    intake._commit_finished()
    assert consumer.commits[-1] == ({P: 7}, True) and consumer.metadata[P] == ""  # past it: the count goes


def test_a_dying_partition_intake_thread_tells_the_worker(intake):
    """Guards against an intake thread that stores its error and stops while the worker goes on
    heartbeating SERVING: the failure must reach the worker at once, not only at close()."""

    class Broken(FakeGroupReader):
        def poll_messages(self, max_messages, timeout_s):
            raise TransportError("consumer error on t: INCONSISTENT_GROUP_PROTOCOL")

        lag = close = pause = resume = lambda self, *a: 0

    intake._consumers = {Priority.INTERACTIVE: Broken(), Priority.BATCH: Broken()}
    thread = threading.Thread(target=intake._run)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert len(intake.failures) == 1 and "INCONSISTENT_GROUP_PROTOCOL" in str(intake.failures[0])
    with pytest.raises(TransportError):
        intake.close()


@pytest.mark.parametrize("listener_type", [CancelListener, DeletionListener])
def test_a_dying_broadcast_listener_tells_the_worker(listener_type):
    """Guards against a worker that no longer hears Cancels (its listener thread died) and runs
    cancelled generations to the end while it looks healthy; likewise one that no longer hears
    deletions and goes on serving an erased user's prefixes."""

    class BrokenTail:
        closed = False

        def poll_messages(self, max_messages, timeout_s):
            raise RuntimeError("tail consumer broke")

        def close(self):
            self.closed = True

    listener = listener_type(KAFKA, default_codec())
    failures = []
    listener._loop, listener._on_record, listener._on_failure = FakeLoop(), lambda c: None, failures.append
    listener._consumer = BrokenTail()
    listener._run()
    assert len(failures) == 1 and "tail consumer broke" in str(failures[0])
    assert listener._consumer.closed


def test_share_and_consumer_group_ids_never_collide():
    """Guards against both intake modes defaulting to one group id: Kafka refuses a share group whose
    id is a consumer group's (GROUP_ID_NOT_FOUND on the share heartbeat), so a share worker started
    after a partition worker with the same --group-id took nothing."""
    settings = WorkerSettings(group_id="chatpipe-inference")
    assert not set(partition_group_ids(settings).values()) & set(share_group_ids(settings).values())
