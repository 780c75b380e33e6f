"""Session-wide fixtures: the project's own Kafka broker, started once per test session.

The broker is the real Apache Kafka (KRaft, one node) that ``chatpipe up`` runs, on free
ports in a temporary state folder, so tests never touch a developer's own ``.chatpipe``.
Every session uses a fresh topic prefix; ``topic_factory`` makes one-off topics.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid

import pytest

from chatpipe.testing.ports import free_port
from tests.java_partitions import java_partitions  # noqa: F401 - a session fixture for every test module

# One torch thread per core of a parallel run, in the pytest workers and in every process their
# stacks start (they inherit the environment): torch's default, a thread per core in each process,
# oversubscribes the cores, and OpenMP's threads spin at their barriers while the other process holds
# the core. Measured here (2 cores): two copies of the grammar test's 50 constrained prompts side by
# side took 233 s each with the default and 49 s each with one thread (one copy alone: 33 s, 54 s).
# Set before torch is imported anywhere in the session; a value already set is kept.
_PARALLEL_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _PARALLEL_WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _PARALLEL_WORKERS)))


def pytest_configure(config):
    config.addinivalue_line("markers", "java: runs a JVM (the java_partitions fixture: javac and the kafka-clients "
                            "jar; the `java` fixture of tests/spark/test_jvm_archive.py); `make test-unit` leaves these out")


JAVA_FIXTURES = {"java_partitions", "java"}

# CHATPIPE_TEST_TIMELINE=FILE: each test's worker, start, end (epoch s) and id appended to FILE, one
# line each (setup and teardown included), to see which worker waited on what (docs/testing.md).
_TIMELINE = os.environ.get("CHATPIPE_TEST_TIMELINE")
if _TIMELINE:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        start = time.time()
        yield
        with open(_TIMELINE, "a") as timeline:
            timeline.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\t{start:.1f}\t{time.time():.1f}\t{item.nodeid}\n")

# The longest files with their seconds in a whole `make test` (4 workers, one torch thread each, 2026-12-05,
# docs/testing.md); a file not listed counts FILE_S.
LONG_FILES = {
    "tests/spark/test_cluster.py": 314, "tests/faults/test_faults.py": 282, "tests/streams/test_pipeline.py": 238,
    "tests/gateway/test_erasure_canary.py": 215, "tests/infra/test_stack_supervisor.py": 169,
    "tests/engine/test_grammar.py": 146, "tests/worker/test_sigterm.py": 144,
    "tests/spark/test_tenancy_and_erasure.py": 142, "tests/streams/test_no_ack_on_failure.py": 136,
    "tests/worker/test_crash_recovery.py": 136, "tests/security/test_secured_pipeline.py": 129,
    "tests/cluster/test_streams_scale_out.py": 116, "tests/gateway/test_chat.py": 106,
    "tests/gateway/test_openai_breadth.py": 102, "tests/worker/test_service.py": 101,
    "tests/cluster/test_cluster.py": 97, "tests/gateway/test_tools.py": 92, "tests/infra/test_stack_full.py": 92,
    "tests/gateway/test_traces.py": 90, "tests/worker/test_worker_failures.py": 87,
    "tests/gateway/test_load.py": 83, "tests/spark/test_kafka_vs_archive.py": 79,
    "tests/security/test_client_security.py": 77, "tests/gateway/test_deadlines_and_outages.py": 73,
    "tests/engine/test_engine_matches_hf.py": 70, "tests/gateway/test_embeddings.py": 54,
    "tests/worker/test_share_lock.py": 46, "tests/engine/test_paged_kernel.py": 40,
    "tests/gateway/test_through_the_pipeline.py": 36, "tests/cache/test_response_cache_stack.py": 120, "tests/engine/test_generate_cli.py": 36,
    "tests/clients/test_tail.py": 35, "tests/engine/test_sampling_features.py": 33,
    "tests/training/test_train_lora.py": 360, "tests/training/test_model_versions.py": 200,
    "tests/training/test_dpo.py": 150, "tests/spark/test_train_on_cluster.py": 240,
}
FILE_S = 10

# Folders whose files share a fixture that is slow to start, and the group each runs in: the whole
# pipeline (tests/gateway/conftest.py), a Spark session with its planted run (tests/spark/conftest.py),
# the default model (tests/engine/conftest.py); and training (tests/training: one run at a time of the
# CPU-heavy trainers, never two beside each other). Each xdist worker has a session of its own, so a group goes
# to one worker whole (pytest_xdist_make_scheduler below) and starts its fixture once; every other file
# is a group of its own.
SHARED_SESSION_GROUPS = {"tests/gateway/": "pipeline", "tests/spark/": "spark", "tests/engine/": "engine",
                         "tests/training/": "training"}


def xdist_group_of(path: str) -> str:
    """The group a test file runs in: its folder's in SHARED_SESSION_GROUPS, else the file alone."""
    return next((group for folder, group in SHARED_SESSION_GROUPS.items() if path.startswith(folder)), path)


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (the Makefile) with the files of a SHARED_SESSION_GROUPS folder as one unit.

    pytest-xdist's own `--dist loadgroup` does not group here: the `@group` it appends to a test's id
    is lost under pytest 9 (seen with xdist 3.8.0 and pytest 9.2.0: every test was a unit of its own,
    so module stacks started on both workers)."""
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler for the mode asked for
    from xdist.scheduler import LoadFileScheduling

    class GroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid.split("::")[0])

    return GroupScheduling(config, log)


@pytest.hookimpl(tryfirst=True)  # before -m deselects anything
def pytest_collection_modifyitems(config, items):
    """Marks what a test's fixtures need, so that a missing marker cannot put a broker or a JVM into
    `make test-unit`: a test on the session broker (``kafka_stack``, directly or through another
    fixture) is ``integration``; one that runs a JVM (``JAVA_FIXTURES``) is ``java``. Then sorts the
    groups longest first: with `--no-loadscope-reorder` (the Makefile) xdist hands them out in
    collection order, so a long one never starts last while the other worker sits idle."""
    seconds: dict[str, int] = {}
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if "kafka_stack" in names and item.get_closest_marker("integration") is None:
            item.add_marker(pytest.mark.integration)
        if names & JAVA_FIXTURES and item.get_closest_marker("java") is None:
            item.add_marker(pytest.mark.java)
        path = item.nodeid.split("::")[0]
        if path not in seconds:
            seconds[path] = LONG_FILES.get(path, FILE_S)
    group_s: dict[str, int] = {}
    for path, s in seconds.items():
        group_s[xdist_group_of(path)] = group_s.get(xdist_group_of(path), 0) + s
    # Stable: a file's tests keep their order, and so do the files of a group.
    items.sort(key=lambda item: -group_s[xdist_group_of(item.nodeid.split("::")[0])])


@pytest.fixture(scope="session")
def kafka_stack(tmp_path_factory):
    """The running broker: yields its StackSettings; stopped (SIGTERM) after the session."""
    from infra.local_kafka import LocalKafka
    from infra.settings import StackSettings

    settings = StackSettings(state_dir=tmp_path_factory.mktemp("chatpipe-state"),
                             kafka_port=free_port(), controller_port=free_port())
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
