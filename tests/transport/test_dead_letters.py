"""One dead-letter builder for every tier (transport/dead_letters.py): the same record whether the
refused message came from confluent-kafka (the inference worker) or from a Faust event (streams)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from confluent_kafka import Message

from schemas.errors import DecodeError
from schemas.records import Header
from transport import tracing
from transport.dead_letters import (
    DELIVERY_COUNT_HEADER,
    dead_letter_for,
    dead_letter_headers,
    dead_letter_key,
)
from transport.message import ConsumedMessage

PARENT = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"


def confluent_message() -> ConsumedMessage:
    return ConsumedMessage(Message(topic="chat.prompts", partition=4, offset=17, key=b"conv", value=b"\xc3\x01bad",
                                   headers=[("traceparent", PARENT.encode()), ("origin", b"app")], error=None))


def faust_message() -> SimpleNamespace:
    """What a Faust event's ``message`` offers: the same attributes, headers possibly as a mapping."""
    return SimpleNamespace(topic="chat.prompts", partition=4, offset=17, key=b"conv", value=b"\xc3\x01bad",
                           headers={"traceparent": PARENT.encode(), "origin": b"app"})


def test_both_kinds_of_message_make_the_same_dead_letter():
    """The original bytes and headers kept as they were, the error as the reason, the component named."""
    error = DecodeError("not Avro single-object encoding")
    letters = [dead_letter_for(m, error, "streams.intake") for m in (confluent_message(), faust_message())]
    for letter in letters:
        assert (letter.source_topic, letter.source_partition, letter.source_offset) == ("chat.prompts", 4, 17)
        assert (letter.key, letter.value) == (b"conv", b"\xc3\x01bad")
        assert letter.headers == [Header("traceparent", PARENT.encode()), Header("origin", b"app")]
        assert (letter.error_type, letter.error_message) == ("DecodeError", "not Avro single-object encoding")
        assert letter.component == "streams.intake"
    a, b = letters
    assert replace(b, event_id=a.event_id, created_at=a.created_at) == a


def test_the_delivery_count_rides_as_a_header():
    """A share-group record rejected after too many deliveries says how many it had."""
    letter = dead_letter_for(confluent_message(), RuntimeError("too many deliveries"), "inference-worker",
                             delivery_count=5)
    assert letter.headers[-1] == Header(DELIVERY_COUNT_HEADER, b"5")


def test_the_letter_is_keyed_by_its_source_topic_and_continues_the_trace():
    for message in (confluent_message(), faust_message(), SimpleNamespace(**{**faust_message().__dict__,
                                                                            "headers": None})):
        assert dead_letter_key(message) == b"chat.prompts"
        ((name, value),) = dead_letter_headers(message)
        assert name == tracing.HEADER
        if message.headers:
            assert tracing.trace_id(value.decode()) == "ab" * 16 and value.decode() != PARENT
        else:
            assert tracing.trace_id(value.decode()) is not None  # a new trace for a message without one


def test_the_same_refusal_of_the_same_record_is_one_dead_letter():
    """A poison record re-read after a crash, or one every worker sees (``chat.cancels`` is read without
    a group), must give letters with one event id, so readers of chat.dlq count it once; another
    record, or another component refusing it, is another letter."""
    error = DecodeError("bad")
    first = dead_letter_for(confluent_message(), error, "inference.cancels")
    again = dead_letter_for(faust_message(), error, "inference.cancels")
    assert first.event_id == again.event_id
    other_offset = SimpleNamespace(**{**faust_message().__dict__, "offset": 18})
    assert dead_letter_for(other_offset, error, "inference.cancels").event_id != first.event_id
    assert dead_letter_for(confluent_message(), error, "streams.intake").event_id != first.event_id
