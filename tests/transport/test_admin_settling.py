"""TopicAdmin asks again while a new topic's metadata settles (transport/admin.py ``_while_settling``),
and only then: an error of any other kind is raised at once. The broker's answers are chosen here (a
real broker gives UNKNOWN_LEADER_EPOCH only now and then, right after a topic's creation, as seen in CI)."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from transport.admin import TopicAdmin
from transport.errors import TransportError
from transport.settings import KafkaSettings


def failing_then(code: int, failures: int):
    calls = {"n": 0}

    def call():
        calls["n"] += 1
        if calls["n"] <= failures:
            raise TransportError("list offsets of t") from KafkaException(KafkaError(code))
        return "described"

    return call, calls


@pytest.mark.parametrize("code", [KafkaError.UNKNOWN_LEADER_EPOCH, KafkaError.NOT_LEADER_FOR_PARTITION,
                                  KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.LEADER_NOT_AVAILABLE])
def test_a_settling_topic_is_asked_again(code):
    admin = TopicAdmin(KafkaSettings(bootstrap_servers="127.0.0.1:9"), timeout_s=5)
    call, calls = failing_then(code, 2)
    assert admin._while_settling(call) == "described" and calls["n"] == 3


def test_other_errors_are_raised_at_once():
    admin = TopicAdmin(KafkaSettings(bootstrap_servers="127.0.0.1:9"), timeout_s=5)
    call, calls = failing_then(KafkaError.TOPIC_AUTHORIZATION_FAILED, 1)
    with pytest.raises(TransportError):
        admin._while_settling(call)
    assert calls["n"] == 1
