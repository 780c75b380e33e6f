"""Fixtures of the worker tests: a fresh topic prefix (the whole catalog) per test, so a worker
never sees another test's requests, and the Kafka reader."""

from __future__ import annotations

import uuid

import pytest

from chatpipe.testing.worker import Reader


@pytest.fixture
def worker_kafka(kafka_stack):
    """KafkaSettings with a topic prefix of this test's own, the catalog applied under it."""
    from transport.admin import TopicAdmin
    from transport.settings import KafkaSettings

    kafka = KafkaSettings(bootstrap_servers=kafka_stack.bootstrap_servers, topic_prefix=f"w{uuid.uuid4().hex[:8]}.")
    TopicAdmin(kafka).apply()
    return kafka


@pytest.fixture
def reader(worker_kafka):
    r = Reader(worker_kafka)
    yield r
    r.close()
