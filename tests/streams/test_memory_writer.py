"""The memory writer (streams/memory_writer.py): turns from the real broker's chat.turns into real memory
(Qdrant local mode) with the real embedding model; what memory must not keep stays out.

The outage half (Qdrant stopped under load, the turns of the window in memory after it) is the fault
suite's (tests/faults, "Qdrant SIGSTOP").
"""

from __future__ import annotations

import time
import uuid

import pytest

from chatpipe.testing.kafka import RecordWriter
from schemas.records import ConversationTurn, Deletion, DeletionScope, FinishReason, now_ms
from schemas.topics import TURNS
from streams.erasures import ErasureRegistry
from streams.memory import ConversationMemory
from streams.memory_settings import MemorySettings
from streams.memory_writer import MemoryWriter, next_positions
from streams.services import StreamsServices
from streams.settings import StreamsSettings
from streams.tokens import TokenCounter
from transport.admin import TopicAdmin

pytestmark = [pytest.mark.integration, pytest.mark.model]


@pytest.fixture
def services(embedder, tmp_path):
    memory = ConversationMemory(MemorySettings(path=tmp_path / "qdrant"), embedder.dim)
    svc = StreamsServices(memory=memory, embedder=embedder, counter=TokenCounter(lambda t: t.split()))
    yield svc
    svc.close()


def turn(user: str, conversation: str, index: int, prompt: str, *, remembered: bool = True,
         created_at: int | None = None) -> ConversationTurn:
    created = created_at or now_ms()
    return ConversationTurn(event_id=uuid.uuid4().hex, conversation_id=conversation, user_id=user, tenant="acme",
                            request_id=uuid.uuid4().hex, turn_index=index, prompt=prompt, answer="Noted.",
                            model="smollm2", worker_id="w1", tokens_in=5, tokens_out=2, queue_ms=1, total_ms=3,
                            finish_reason=FinishReason.STOP if remembered else FinishReason.ERROR,
                            created_at=created, completed_at=created + 5, remembered=remembered)


def test_kept_turns_reach_memory_and_the_rest_stays_out(kafka, services, tmp_path):
    """A remembered turn is upserted (once, however often it is read), a turn memory does not keep (a
    failed answer) is not, nor one of a user forgotten before it was written; the group commits it all."""
    erasures = ErasureRegistry()
    erasures.add(Deletion(tenant="acme", user_id="bob", scope=DeletionScope.USER, created_at=now_ms() + 60_000))
    kept = [turn("ada", "c1", 0, "My cat is called Tom."), turn("ada", "c2", 0, "I live in Lyon.")]
    failed = turn("ada", "c1", 1, "What is 2+2?", remembered=False)
    forgotten = turn("bob", "c3", 0, "My dog is called Rex.")
    with RecordWriter(kafka) as producer:
        for t in [*kept, failed, forgotten, kept[0]]:  # the first one delivered twice
            producer.send(kafka.topic(TURNS), t, key=t.conversation_id)
    settings = StreamsSettings(app_id=f"test-{uuid.uuid4().hex[:6]}", state_dir=tmp_path / "state")
    writer = MemoryWriter(kafka, settings, services, erasures, f"{settings.app_id}.memory")
    failures: list[BaseException] = []
    writer.start(failures.append)
    try:
        deadline = time.monotonic() + 60
        while writer.upserted + writer.not_remembered + writer.erased < 5 and not failures:
            assert time.monotonic() < deadline, (writer.upserted, writer.not_remembered, writer.erased)
            time.sleep(0.2)
    finally:
        writer.close()
    assert not failures
    assert (writer.not_remembered, writer.erased) == (1, 1)
    memory = services.memory
    assert memory.count(tenant="acme", user_id="ada") == 2 and memory.count(tenant="acme", user_id="bob") == 0
    lag = {g.group: g.lag for g in TopicAdmin(kafka).group_lags()}
    assert lag[f"{settings.app_id}.memory"] == 0, lag


def test_a_turn_whose_user_is_forgotten_while_it_is_written_is_deleted_again(kafka, services, tmp_path):
    """The forget agent deletes a user's points without a lock against the writer: a deletion registered
    between the writer's first look and its upsert would leave the point behind, so the writer looks again
    after the upsert and deletes what it wrote for a subject erased meanwhile."""
    erasures = ErasureRegistry()
    real_upsert = services.memory.upsert

    def upsert_then_forget(turns, vectors):  # the forget agent registering the deletion at that moment
        real_upsert(turns, vectors)
        erasures.add(Deletion(tenant="acme", user_id="ada", scope=DeletionScope.USER, created_at=now_ms() + 1))

    services.memory.upsert = upsert_then_forget
    settings = StreamsSettings(app_id="test", state_dir=tmp_path / "state")
    writer = MemoryWriter(kafka, settings, services, erasures, "test.memory")
    t = turn("ada", "c1", 0, "My cat is called Tom.")
    from types import SimpleNamespace

    from schemas.codec import default_codec

    # what a consumed record offers the writer (transport.message.ConsumedMessage wraps a librdkafka one)
    message = SimpleNamespace(topic=kafka.topic(TURNS), partition=0, offset=7, value=default_codec().encode(t),
                              traceparent=None)
    writer.write([message])
    assert services.memory.count(tenant="acme", user_id="ada") == 0 and writer.erased == 1 and writer.upserted == 0
    assert next_positions([message]) == {(kafka.topic(TURNS), 0): 8}
