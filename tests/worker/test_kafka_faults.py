"""Which Kafka errors are the record's fault and which the infrastructure's, without a broker:
consumer errors by code (``transport.group_reader``, ``transport.share_reader``), reply
addresses (``transport.reply_address``) and failed reply sends (``transport.failures``)."""

from __future__ import annotations

import asyncio

import pytest
from confluent_kafka import KafkaError, KafkaException, Message

from chatpipe.testing.worker import make_request
from inference.worker.errors import ReplyAddressError
from transport.errors import DeliveryError, TransportError
from transport.failures import Fault, classify
from transport.failures import ErrorBudget
from transport.group_reader import GroupReader
from transport.reply_address import ReplyAddresses, reserved_topics
from transport.settings import KafkaSettings
from transport.tail_reader import TailReader

KAFKA = KafkaSettings(bootstrap_servers="127.0.0.1:9", topic_prefix="u.")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- consumer errors ---------------------------------------------------------------------------


def ErrorMessage(code: int) -> Message:  # reads as the event it builds
    """A real confluent-kafka error event (what ``consume`` returns for a consumer error)."""
    return Message(topic="u.t", partition=0, offset=-1, error=KafkaError(code))


class FakeConsumer:
    """Stands in for librdkafka's consumer, which cannot be made to return a chosen error event on demand
    (a real broker gives UNKNOWN_TOPIC_OR_PART once, when a topic is deleted under a consumer; the events
    handed out here are real ``confluent_kafka.Message`` error events)."""

    def __init__(self, batches) -> None:
        self.batches = list(batches)

    def consume(self, n, timeout):
        return self.batches.pop(0) if self.batches else []

    def memberid(self):  # a member of its group: only the events are made up
        return "member-1"

    def close(self):
        pass


@pytest.mark.parametrize("code", [KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._TRANSPORT,
                                  KafkaError._ALL_BROKERS_DOWN, KafkaError._MAX_POLL_EXCEEDED,
                                  KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.COORDINATOR_NOT_AVAILABLE])
def test_transient_consumer_errors_are_polled_through(code):
    """Guards against an intake thread that died on the first UNKNOWN_TOPIC_OR_PART (a topic being
    recreated) or broker hiccup: confluent-kafka calls nearly every error non-retriable, and
    poll_messages raised on anything not retriable()."""
    assert not KafkaError(code).retriable()  # why retriable() could not decide
    consumer = GroupReader(KAFKA, group_id="g", topics=["u.t"])
    consumer._consumer.close()
    consumer._consumer = FakeConsumer([[ErrorMessage(code)]])
    assert consumer.poll_messages(10, 0) == []


@pytest.mark.parametrize("code", [KafkaError.INCONSISTENT_GROUP_PROTOCOL, KafkaError.GROUP_AUTHORIZATION_FAILED,
                                  KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError._AUTO_OFFSET_RESET,
                                  KafkaError.GROUP_ID_NOT_FOUND])
def test_fatal_consumer_errors_raise(code):
    assert classify(KafkaError(code)) is not Fault.TRANSIENT
    consumer = GroupReader(KAFKA, group_id="g", topics=["u.t"])
    consumer._consumer.close()
    consumer._consumer = FakeConsumer([[ErrorMessage(code)]])
    with pytest.raises(TransportError, match=KafkaError(code).name()):
        consumer.poll_messages(10, 0)


def test_the_tail_consumer_classifies_errors_like_the_group_consumer():
    """The cancel listener's consumer used to log every error and poll on: an authorisation error left the
    worker without cancels, silently. Now a transient error is polled through and any other raises."""
    tail = TailReader.__new__(TailReader)  # __init__ asks a broker for the topic's partitions
    tail.topics, tail.errors = ["u.chat.cancels"], ErrorBudget()
    tail.topic_check_s, tail._next_check = 10.0, float("inf")  # no metadata check (it asks a broker)
    tail._consumer = FakeConsumer([[ErrorMessage(KafkaError.UNKNOWN_TOPIC_OR_PART)],
                                   [ErrorMessage(KafkaError.TOPIC_AUTHORIZATION_FAILED)]])
    assert tail.poll_messages(10, 0) == []
    with pytest.raises(TransportError, match="TOPIC_AUTHORIZATION_FAILED"):
        tail.poll_messages(10, 0)


def test_transient_errors_past_the_budget_raise():
    """Guards against a worker that polls through a broker outage for ever: past the retry budget it
    must exit (the supervisor restarts it) rather than sit there looking alive."""
    clock = Clock()
    budget = ErrorBudget(budget_s=60, quiet_s=15, clock=clock)
    err = KafkaError(KafkaError._TRANSPORT)
    for _ in range(7):  # an outage: an error every 10 s (librdkafka's reconnect backoff)
        budget.check("c", err)
        clock.now += 10
    with pytest.raises(TransportError, match="retry budget"):
        budget.check("c", err)


def test_separate_blips_and_a_message_between_reset_the_budget():
    clock = Clock()
    budget = ErrorBudget(budget_s=60, quiet_s=15, clock=clock)
    err = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
    for _ in range(20):  # one error every 30 s: separate blips, each recovered
        budget.check("c", err)
        clock.now += 30
    for _ in range(20):  # errors close together, but messages come between them
        budget.check("c", err)
        budget.ok()
        clock.now += 10


# -- reply addresses ---------------------------------------------------------------------------


class Topics:
    """The broker's topics as ReplyAddresses reads them; counts the reads."""

    def __init__(self, topics: dict[str, int]) -> None:
        self.topics, self.reads = topics, 0

    def __call__(self) -> dict[str, int]:
        self.reads += 1
        return dict(self.topics)


def _check(addresses: ReplyAddresses, reply_to: str | None, reply_partition: int | None = 0) -> None:
    """What the worker does before generating (worker.py ``_answer_in``)."""
    req = make_request(1, reply_to=reply_to, reply_partition=reply_partition)
    if problem := asyncio.run(addresses.problem(req.reply_to or None, req.reply_partition)):
        raise ReplyAddressError(problem)


@pytest.mark.parametrize("reply_to, partition, reason", [
    ("u.chat.replies", 6, "reply_partition 6 is outside 'u.chat.replies', which has 6 partition(s): 0-5"),
    ("u.chat.replies", -2, "reply_partition -2 is negative"),
    ("u.nowhere", 0, "reply_to 'u.nowhere' is not a topic on the broker"),
    ("bad name!", 0, "is not a valid Kafka topic name"),
    ("u.chat.inference.requests", 0, "is a topic of the pipeline itself"),
    ("u.chat.prompts", 0, "is a topic of the pipeline itself"),
])
def test_unanswerable_reply_addresses_are_refused_with_the_reason(reply_to, partition, reason):
    """Guards against a reply address that made the chunk send raise and the worker exit (and every
    restarted worker die on the same record): it must be refused, with a reason, before generating."""
    addresses = ReplyAddresses(Topics({"u.chat.replies": 6, "u.chat.prompts": 6, "u.chat.inference.requests": 6}),
                               reserved=reserved_topics("u."))
    with pytest.raises(ReplyAddressError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        _check(addresses, reply_to, partition)


def test_good_addresses_pass_from_the_cache_and_new_topics_are_found():
    clock = Clock()
    topics = Topics({"u.chat.replies": 6})
    addresses = ReplyAddresses(topics, fresh_s=30, recheck_s=1, clock=clock)
    _check(addresses, "u.chat.replies", 5)
    _check(addresses, "u.chat.replies", None)
    _check(addresses, None)
    assert topics.reads == 1
    with pytest.raises(ReplyAddressError):
        _check(addresses, "u.new", 0)  # read within recheck_s: not read again
    topics.topics["u.new"] = 1
    with pytest.raises(ReplyAddressError):
        _check(addresses, "u.new", 0)
    assert topics.reads == 1  # a flood of bad records costs one read per recheck_s
    clock.now += 1.5
    _check(addresses, "u.new", 0)  # created meanwhile: found on the next look
    assert topics.reads == 2


def test_metadata_away_is_the_infrastructures_fault_unless_the_address_is_known():
    clock = Clock()
    topics = Topics({"u.chat.replies": 6})
    addresses = ReplyAddresses(topics, fresh_s=30, recheck_s=1, clock=clock)
    _check(addresses, "u.chat.replies", 1)

    def away():
        raise TransportError("cannot reach Kafka")

    addresses._list = away
    clock.now += 60
    _check(addresses, "u.chat.replies", 1)  # known good: used as it was
    with pytest.raises(TransportError):
        _check(addresses, "u.other", 0)  # never seen: not the record's fault


@pytest.mark.parametrize("exc, fault", [
    (KafkaException(KafkaError(KafkaError._UNKNOWN_PARTITION)), True),
    (DeliveryError("u.chat.replies[99]: Local: Unknown partition", code=KafkaError._UNKNOWN_PARTITION), True),
    (DeliveryError("x[0]: Broker: Unknown topic or partition", code=KafkaError.UNKNOWN_TOPIC_OR_PART), True),
    (DeliveryError("x[0]: Broker: Message size too large", code=KafkaError.MSG_SIZE_TOO_LARGE), True),
    (DeliveryError("x[0]: Local: Message timed out", code=KafkaError._MSG_TIMED_OUT), False),
    (DeliveryError("x[0]: Local: All broker connections are down", code=KafkaError._ALL_BROKERS_DOWN), False),
    (KafkaException(KafkaError(KafkaError._QUEUE_FULL)), False),
    (RuntimeError("engine"), False),
])
def test_reply_send_errors_are_classified_by_code(exc, fault):
    """Guards against a record's fault (a partition outside the reply topic) being taken for a broker
    failure, and against a broker outage being taken for the record's fault (dead-lettering good
    requests)."""
    assert (classify(exc, address_from_record=True) is Fault.RECORD) is fault
