"""Session-wide fixtures: the project's own Kafka broker, started once per test session.

The broker is the real Apache Kafka (KRaft, one node) that ``chatpipe up`` runs, on free
ports in a temporary state folder, so tests never touch a developer's own ``.chatpipe``.
Every session uses a fresh topic prefix; ``topic_factory`` makes one-off topics.
"""

from __future__ import annotations

import itertools
import random
import socket
import uuid

import pytest

from tests.java_partitions import java_partitions  # noqa: F401 - a session fixture for every test module


_HANDED_OUT: set[int] = set()


def _free_port() -> int:
    """A free port, never one this process was handed before: the OS may give a just-closed port
    again, and a test asking for several (a stack's Kafka, controller and /metrics ports) would then
    get the same one twice (``chatpipe up`` refused such flags once in CI)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def free_port_block(n: int) -> int:
    """The first of ``n`` consecutive free ports (a stack gives its k-th worker ``base + k``), below
    Linux's ephemeral range (32768-60999): a port picked by binding 0 lies in that range, where
    any client connection made meanwhile (a Kafka client, another xdist worker's) may take
    ``base + 1`` before the second worker binds it, as happened once in CI."""
    rng = random.Random()
    while True:
        base = rng.randrange(20000, 32700 - n)
        socks = []
        try:
            for port in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()


@pytest.fixture(scope="session")
def kafka_stack(tmp_path_factory):
    """The running broker: yields its StackSettings; stopped (SIGTERM) after the session."""
    from infra.local_kafka import LocalKafka
    from infra.settings import StackSettings

    settings = StackSettings(state_dir=tmp_path_factory.mktemp("chatpipe-state"),
                             kafka_port=_free_port(), controller_port=_free_port())
    kafka = LocalKafka(settings)
    kafka.up()
    yield settings
    assert kafka.down(), "the test broker had died before the end of the session"


@pytest.fixture(scope="session")
def kafka_settings(kafka_stack):
    """KafkaSettings for the test broker, with a topic prefix unique to this session."""
    from transport.settings import KafkaSettings

    return KafkaSettings(bootstrap_servers=kafka_stack.bootstrap_servers,
                         topic_prefix=f"t{uuid.uuid4().hex[:8]}.")


@pytest.fixture(scope="session")
def topic_admin(kafka_settings):
    from transport.admin import TopicAdmin

    return TopicAdmin(kafka_settings)


@pytest.fixture(scope="session")
def catalog_topics(topic_admin):
    """The whole topic catalog applied under the session's prefix; returns the changes made."""
    return topic_admin.apply()


_topic_counter = itertools.count()


@pytest.fixture
def topic_factory(topic_admin, kafka_settings, request):
    """``topic_factory(partitions=3, config=None) -> name``: a fresh topic for one test."""

    def make(partitions: int = 3, config: dict[str, str] | None = None) -> str:
        base = request.node.name.replace("[", "-").replace("]", "")[:60]
        name = f"{kafka_settings.topic_prefix}{base}.{next(_topic_counter)}"
        topic_admin.create_topic(name, partitions, config)
        return name

    return make


@pytest.fixture
def group_id(request) -> str:
    return f"test-{request.node.name[:40]}-{uuid.uuid4().hex[:6]}"
