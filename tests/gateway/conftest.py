"""Fixtures of the gateway tests: the whole pipeline once for the folder."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture(scope="package")
def pipeline(kafka_stack, tmp_path_factory):
    """Streams + inference worker + gateway on the session broker, under a topic prefix of their own.

    Package-scoped: the folder's files run on one xdist worker (tests/conftest.py), and the three
    processes stop when its last test is done instead of idling through the rest of the run."""
    from chatpipe.testing.gateway import start_pipeline
    from transport.admin import TopicAdmin
    from transport.settings import KafkaSettings

    kafka = KafkaSettings(bootstrap_servers=kafka_stack.bootstrap_servers, topic_prefix=f"g{uuid.uuid4().hex[:8]}.")
    TopicAdmin(kafka).apply()
    stack = start_pipeline(kafka, tmp_path_factory.mktemp("pipeline"))
    yield stack
    codes = stack.stop()
    assert codes == {"gateway": 0, "inference": 0, "streams": 0}, f"unclean shutdown: {codes}"
