"""Fixtures of the streams tests."""

from __future__ import annotations

import pytest

# --- memory (Qdrant + embeddings) fixtures --------------------------------------------------------


@pytest.fixture(scope="session")
def embedder():
    """The real all-MiniLM-L6-v2 Embedder, loaded once per session, offline as the CLI runs it."""
    from streams.embeddings import Embedder
    from streams.memory_settings import MemorySettings

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")  # what the CLI sets; the Embedder itself never goes online
        yield Embedder(MemorySettings())


@pytest.fixture(scope="session")
def qdrant_server(tmp_path_factory):
    """One real Qdrant server (../shared/tools/qdrant) on free ports; yields its URL. Skips without it."""
    from chatpipe.testing.qdrant import QDRANT_TOOL, SKIP_REASON, QdrantPeer

    if not QDRANT_TOOL.exists():
        pytest.skip(SKIP_REASON)
    peer = QdrantPeer(tmp_path_factory.mktemp("qdrant-single"), "node")
    peer.start()
    try:
        peer.wait_ready()
        yield peer.url
    finally:
        peer.stop()


# --- the broker ---------------------------------------------------------------------------------------


@pytest.fixture
def kafka(kafka_stack):
    """KafkaSettings with a topic prefix of this test's own (its consumer groups and topics start empty), the
    catalog applied under it. test_pipeline.py shares one prefix per module instead (its own fixture)."""
    import uuid

    from transport.admin import TopicAdmin
    from transport.settings import KafkaSettings

    settings = KafkaSettings(bootstrap_servers=kafka_stack.bootstrap_servers, topic_prefix=f"f{uuid.uuid4().hex[:8]}.")
    TopicAdmin(settings).apply()
    return settings
