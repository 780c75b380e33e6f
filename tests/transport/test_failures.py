"""The one failure policy (``transport.failures``): every category of ``classify`` with real exception
objects, and the one ``Retrier``; and the one reply-address rule as streams intake applies it."""

from __future__ import annotations

import asyncio
import errno
import sqlite3
from types import SimpleNamespace

import httpx
import pytest
from confluent_kafka import KafkaError, KafkaException

from schemas.errors import DecodeError, EncodeError, UnknownSchemaError
from transport.errors import DeliveryError, QueueFullError, TransportError
from transport.failures import Fault, OutageError, Retrier, classify, kafka_error


def kafka(code: int, *, fatal: bool = False) -> KafkaException:
    return KafkaException(KafkaError(code, fatal=fatal))


@pytest.mark.parametrize("exc, fault", [
    # the record's
    (DecodeError("not Avro", topic="p.chat.prompts", partition=0, offset=3), Fault.RECORD),
    (UnknownSchemaError("fingerprint 00"), Fault.RECORD),
    (kafka(KafkaError.MSG_SIZE_TOO_LARGE), Fault.RECORD),
    (DeliveryError("t[0]: Broker: Invalid record", code=KafkaError.INVALID_RECORD), Fault.RECORD),
    # the infrastructure's
    (kafka(KafkaError._TRANSPORT), Fault.TRANSIENT),
    (kafka(KafkaError._ALL_BROKERS_DOWN), Fault.TRANSIENT),
    (KafkaError(KafkaError.NOT_COORDINATOR), Fault.TRANSIENT),  # a consumer's error event
    (kafka(KafkaError.UNKNOWN_TOPIC_OR_PART), Fault.TRANSIENT),  # our own topic being recreated
    (DeliveryError("t[0]: Local: Message timed out", code=KafkaError._MSG_TIMED_OUT), Fault.TRANSIENT),
    (QueueFullError("queue full", code=KafkaError._QUEUE_FULL), Fault.TRANSIENT),
    (TransportError("cannot reach Kafka at 127.0.0.1:9"), Fault.TRANSIENT),
    (OSError(errno.ENOSPC, "No space left on device"), Fault.TRANSIENT),
    (PermissionError(errno.EACCES, "Permission denied"), Fault.TRANSIENT),
    (OSError(errno.EROFS, "Read-only file system"), Fault.TRANSIENT),
    (sqlite3.OperationalError("database or disk is full"), Fault.TRANSIENT),
    (httpx.ConnectError("[Errno 111] Connection refused"), Fault.TRANSIENT),
    (httpx.ReadTimeout("timed out"), Fault.TRANSIENT),
    (OutageError("memory recall: still failing after 60 s"), Fault.TRANSIENT),
    # a bug or the configuration
    (kafka(KafkaError.SASL_AUTHENTICATION_FAILED), Fault.FATAL),
    (kafka(KafkaError.TOPIC_AUTHORIZATION_FAILED), Fault.FATAL),  # a topic of our own
    (kafka(KafkaError._TRANSPORT, fatal=True), Fault.FATAL),
    (kafka(KafkaError.OFFSET_OUT_OF_RANGE), Fault.FATAL),
    (EncodeError("field text: not a string"), Fault.FATAL),
    (TypeError("unexpected None"), Fault.FATAL),
    (sqlite3.ProgrammingError("closed database"), Fault.FATAL),
])
def test_classify_names_whose_fault_each_error_is(exc, fault):
    assert classify(exc) is fault


@pytest.mark.parametrize("code", [KafkaError._UNKNOWN_PARTITION, KafkaError._UNKNOWN_TOPIC,
                                  KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.TOPIC_EXCEPTION,
                                  KafkaError.TOPIC_AUTHORIZATION_FAILED])
def test_an_address_the_record_named_is_the_records_fault(code):
    """Guards against a reply address outside the topic taken for a broker failure (the worker exited on
    it, and every restarted worker died on the same record)."""
    exc = DeliveryError("reply[99]: refused", code=code)
    assert classify(exc, address_from_record=True) is Fault.RECORD
    assert classify(exc) is not Fault.RECORD
    assert classify(kafka(KafkaError._MSG_TIMED_OUT), address_from_record=True) is Fault.TRANSIENT


def test_the_kafka_code_is_found_through_causes():
    try:
        try:
            raise kafka(KafkaError.GROUP_AUTHORIZATION_FAILED)
        except KafkaException as exc:
            raise TransportError("describe group g: refused") from exc
    except TransportError as wrapped:
        assert kafka_error(wrapped).code() == KafkaError.GROUP_AUTHORIZATION_FAILED
        assert classify(wrapped) is Fault.FATAL


def test_qdrant_answers_are_classified_by_status():
    from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse

    def answer(status: int) -> UnexpectedResponse:
        return UnexpectedResponse(status_code=status, reason_phrase="x", content=b"{}", headers=httpx.Headers())

    assert classify(answer(503)) is Fault.TRANSIENT and classify(answer(429)) is Fault.TRANSIENT
    assert classify(answer(400)) is Fault.FATAL
    assert classify(ResponseHandlingException(httpx.ConnectError("refused"))) is Fault.TRANSIENT


def test_declared_faults_of_upper_tiers():
    from inference.worker.errors import ReplyAddressError
    from streams.errors import InfrastructureUnavailableError
    from streams.memory import MemoryRequestError, MemoryUnavailableError

    assert classify(ReplyAddressError("reply_to x is not a topic")) is Fault.RECORD
    assert classify(MemoryUnavailableError("Qdrant away")) is Fault.TRANSIENT
    assert classify(MemoryRequestError("HTTP 400")) is Fault.TRANSIENT
    assert isinstance(InfrastructureUnavailableError("x"), OutageError)


# --- Retrier ------------------------------------------------------------------------------------


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep_blocking(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    async def sleep(self, seconds: float) -> None:
        self.sleep_blocking(seconds)


def retrier(t: FakeTime, budget_s: float = 10.0) -> Retrier:
    return Retrier(budget_s, 0.5, 4.0, sleep=t.sleep, blocking_sleep=t.sleep_blocking, clock=t.clock)


def test_transient_faults_then_success_return_the_result_after_capped_backoff():
    t, calls = FakeTime(), []

    def call():
        calls.append(1)
        if len(calls) < 6:
            raise httpx.ConnectError("refused")
        return "ok"

    r = retrier(t, budget_s=60)
    assert r.call_blocking("recall", call) == "ok"
    assert t.slept == [0.5, 1.0, 2.0, 4.0, 4.0] and r.retries == 5


def test_a_spent_budget_raises_an_outage_from_the_last_fault():
    t = FakeTime()

    async def write():
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OutageError, match="archive write: still failing after 10 s") as info:
        asyncio.run(retrier(t).call("archive write", write))
    assert t.now == pytest.approx(10.0) and isinstance(info.value.__cause__, OSError)


@pytest.mark.parametrize("exc", [DecodeError("bad bytes"), TypeError("bug"), OutageError("spent elsewhere"),
                                 kafka(KafkaError.MSG_SIZE_TOO_LARGE)])
def test_record_faults_bugs_and_spent_budgets_are_not_retried(exc):
    t, calls = FakeTime(), []

    def call():
        calls.append(1)
        raise exc

    with pytest.raises(type(exc)):
        retrier(t).call_blocking("send", call)
    assert calls == [1] and t.slept == []


def test_each_call_has_its_own_budget():
    t = FakeTime()
    r = retrier(t, budget_s=1.0)
    fails = [True]

    def call():
        if fails:
            fails.pop()
            raise TransportError("blip")
        return 1

    t.now = 100.0
    assert r.call_blocking("a", call) == 1
    fails.append(True)
    t.now = 500.0  # long after the first call's deadline
    assert r.call_blocking("b", call) == 1


# --- the reply-address rule, as streams intake applies it ----------------------------------------


def test_streams_intake_refuses_a_reply_to_naming_a_pipeline_topic_with_a_dead_letter():
    """Guards against a reply_to naming chat.prompts passing streams (only the worker refused it):
    intake must dead-letter it with the reason, send no chunk there, and not serve it."""
    from streams.errors import InvalidReplyAddressError
    from streams.faults import Retrier as StreamsRetrier
    from streams.refusals import Refusals
    from tests.streams.stand_in import prompt
    from transport.reply_address import ReplyAddresses
    from transport.settings import KafkaSettings

    settings = KafkaSettings(bootstrap_servers="127.0.0.1:9", topic_prefix="p.")
    replies = ReplyAddresses.of(settings, lambda: {"p.chat.prompts": 6, "p.chat.replies": 6})
    letters: list[BaseException] = []

    class DeadLetters:
        async def send(self, message, exc, outbox):
            letters.append(exc)

    class NoChunks:
        def send(self, *a, **kw):
            raise AssertionError("no chunk may go to a pipeline topic")

    refusals = Refusals(DeadLetters(), StreamsRetrier(1, 0.01, 0.01), NoChunks(), replies)
    event = SimpleNamespace(timestamp=0.0)  # the consumed message: only its timestamp is read here
    bad = prompt("acme", "ada", "c1", "hi", reply_to="p.chat.prompts", reply_partition=0)
    assert asyncio.run(refusals.admit(event, bad, None)) is False
    assert len(letters) == 1 and isinstance(letters[0], InvalidReplyAddressError)
    assert "p.chat.prompts is a topic of the pipeline itself" in str(letters[0])
    good = prompt("acme", "ada", "c1", "hi", reply_to="p.chat.replies", reply_partition=0)
    assert asyncio.run(refusals.admit(event, good, None)) is True and len(letters) == 1
