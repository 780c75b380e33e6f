"""No agent acks a batch whose effects did not happen: the real ``chatpipe streams`` process, the real
broker, a real Qdrant server (``../shared/tools/qdrant``) and the real embedding model.

Each test makes the infrastructure fail for longer than the (shortened) retry budget, sees the
worker exit with code 75 (``streams.faults.EXIT_INFRASTRUCTURE``) instead of acking, repairs the
fault, restarts the worker as a supervisor would, and checks that every record of the failed
batches was processed exactly once downstream. Before the fix Faust acked the failed batch (in
``take_events``' ``finally``), restarted the agent on the next one and the process never exited:
the records were lost.
"""

from __future__ import annotations

import time
from collections import Counter
from datetime import datetime, timezone

import pytest

from chatpipe.testing.kafka import RecordWriter
from chatpipe.testing.qdrant import QDRANT_TOOL, SKIP_REASON, QdrantPeer
from chatpipe.testing.streams import StreamsWorker, Tap
from schemas.codec import default_codec
from schemas.records import Deletion, DeletionScope, Feedback, FeedbackKind
from schemas.topics import deletion_key
from streams.faults import EXIT_INFRASTRUCTURE
from tests.streams.stand_in import Conversation, answer, prompt
from transport.archive import hour_dir, read_messages

pytestmark = pytest.mark.integration

# Short enough to keep the tests quick; the defaults are 60 s and 300 s.
FAST_FAULTS = dict(retry_budget_s=3, retry_backoff_s=0.2, retry_max_backoff_s=1, archive_retry_budget_s=3)


@pytest.fixture
def producer(kafka):
    with RecordWriter(kafka) as p:
        yield p


def wait_exit(worker: StreamsWorker, timeout_s: float = 120) -> int:
    try:
        return worker.proc.wait(timeout_s)
    except Exception:  # noqa: BLE001 - TimeoutExpired: the worker kept running with the fault
        raise AssertionError(f"chatpipe streams did not exit within {timeout_s:.0f}s of the fault:\n"
                             f"{worker.tail()}") from None


def counts(tap: Tap, field: str) -> Counter:
    codec = default_codec()
    return Counter(getattr(codec.decode(m.value()), field) for m in tap.drain(1.0))


def test_qdrant_away_past_the_budget_exits_unacked_and_the_restart_serves_every_record(kafka, producer, tmp_path):
    """Prompts (intake), a response (record) and a Deletion (forget) arrive while the Qdrant server is
    dead. Memory is an enhancement: the prompts are served at once without recall (``memory_degraded``)
    and the response becomes its turn; what needs Qdrant itself, the deletion's erasure and the memory
    writer's upsert of that turn, is retried and past the budget the worker exits 75 without acking.
    After Qdrant and the worker are back, each prompt was requested once, the response made one turn,
    the user is forgotten, and the turn recorded during the outage is in memory."""
    if not QDRANT_TOOL.exists():
        pytest.skip(SKIP_REASON)
    from streams.memory import ConversationMemory
    from streams.memory_settings import MemorySettings

    qdrant = QdrantPeer(tmp_path, "qdrant")
    qdrant.start()
    qdrant.wait_ready()
    (tmp_path / "streams").mkdir()
    worker = StreamsWorker(kafka, tmp_path / "streams", **FAST_FAULTS)
    worker.env.update(CHATPIPE_MEMORY_URL=qdrant.url, CHATPIPE_MEMORY_RETRIES="1", CHATPIPE_MEMORY_TIMEOUT_S="1",
                      CHATPIPE_MEMORY_RETRY_BACKOFF_S="0.1")
    requests, turns = Tap(kafka, "chat.inference.requests"), Tap(kafka, "chat.turns")
    audits = Tap(kafka, "chat.deletions.audit")
    try:
        worker.start()
        kept = Conversation(producer, requests, turns, "acme", "u-kept", "conv-kept")
        kept.turn("My favourite colour is teal.", "Teal, noted.")
        pending = kept.ask("What else should I know?")  # its response comes during the outage
        gone = Conversation(producer, requests, turns, "acme", "u-gone", "conv-gone")
        gone.turn("My bike is red.", "Red, noted.")
        memory = ConversationMemory(MemorySettings(url=qdrant.url), 384)
        try:  # the memory writer has both turns before the outage, so the erasure has a point to delete
            deadline = time.monotonic() + 60
            while memory.count(tenant="acme", user_id="u-gone") < 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert memory.count(tenant="acme", user_id="u-gone") == 1, "the memory writer never wrote the turn"
        finally:
            memory.close()

        qdrant.kill()
        reply_to = kafka.topic("chat.replies")
        prompts = [prompt("acme", f"u{i}", f"conv-out-{i}", f"Question {i} during the outage?", reply_to=reply_to)
                   for i in range(3)]
        for p in prompts:
            producer.send(kafka.topic("chat.prompts"), p, key=p.conversation_id)
        producer.flush()
        ids = {p.request_id for p in prompts}
        # served while memory is away, without recall: a prompt does not wait for memory (recall_timeout_s)
        during = worker.records(requests, 3, timeout_s=60, where=lambda r: r.request_id in ids)
        assert all(r.memory_degraded and r.recalled_turn_ids == [] for r in during), during
        assert worker.proc.poll() is None, worker.tail()
        producer.send(kafka.topic("chat.responses"), answer(pending, "Nothing else."), key=pending.conversation_id)
        deletion = Deletion(scope=DeletionScope.USER, tenant="acme", user_id="u-gone")
        producer.send(kafka.topic("chat.deletions"), deletion, key=deletion_key(deletion.tenant, deletion.user_id))
        producer.flush()

        # the erasure and the memory writer's upsert of the new turn need Qdrant: past the budget, exit 75
        assert wait_exit(worker) == EXIT_INFRASTRUCTURE, worker.tail()
        assert "without acknowledging its batch" in worker.log.read_text()

        qdrant.start()
        qdrant.wait_ready()
        worker.start()
        worker.records(turns, 1, timeout_s=120, where=lambda t: t.request_id == pending.request_id)
        forgot = worker.records(audits, 6, timeout_s=120, where=lambda a: a.deletion_event_id == deletion.event_id
                                and a.component == "streams.forget")  # one per conversation partition
        served, recorded = counts(requests, "request_id"), counts(turns, "request_id")
        # exactly once; a stall exit that could not commit first may serve a prompt again (at-least-once)
        assert all(1 <= served[i] <= 1 + worker.uncommitted_stalls for i in ids), (served, worker.uncommitted_stalls)
        assert recorded[pending.request_id] == 1, recorded
        assert sum(a.memory_points_deleted for a in forgot) == 1 and sum(a.conversations_cleared for a in forgot) == 1
        memory = ConversationMemory(MemorySettings(url=qdrant.url), 384)
        try:
            assert memory.count(tenant="acme", user_id="u-gone") == 0
            deadline = time.monotonic() + 60  # the memory writer's backlog, written after the restart
            while memory.count(tenant="acme", user_id="u-kept") < 2 and time.monotonic() < deadline:
                time.sleep(0.5)
            assert memory.count(tenant="acme", user_id="u-kept") == 2, "the turn recorded during the outage"
        finally:
            memory.close()
        assert worker.stop() == 0, worker.tail()
    finally:
        for tap in (requests, turns, audits):
            tap.close()
        if worker.proc is not None and worker.proc.poll() is None:
            worker.proc.kill()
            worker.proc.wait()
        qdrant.stop()


def _feedback_bytes(i: int) -> bytes:
    return default_codec().encode(Feedback(conversation_id="conv-fb", user_id="u1", tenant="acme",
                                           request_id=f"r{i}", kind=FeedbackKind.THUMBS_UP))


def test_an_unwritable_archive_exits_unacked_and_the_restart_archives_every_message_once(kafka, tmp_path):
    """A batch of feedback whose earlier records are stamped two hours back (their folder cannot be
    created: a file is in the way, a real ENOTDIR/EEXIST from the filesystem) and the rest now: the
    worker must exit 75 without acking; after the folder is freed and the worker restarted, every
    message of the topic is in the archive exactly once."""
    from confluent_kafka import Producer

    (tmp_path / "streams").mkdir()
    worker = StreamsWorker(kafka, tmp_path / "streams", **FAST_FAULTS)
    topic = kafka.topic("chat.feedback")
    raw = Producer({**kafka.client_config(), "enable.idempotence": True})
    now = int(time.time() * 1000)
    earlier = now - 2 * 3_600_000
    try:
        worker.start()
        for i in range(3):
            raw.produce(topic, _feedback_bytes(i), b"conv-fb", timestamp=now)
        raw.flush(10)
        deadline = time.monotonic() + 60
        while sum(1 for _ in (worker.archive_dir / topic).rglob("*.avro")) == 0 and time.monotonic() < deadline:
            time.sleep(0.3)

        blocked = hour_dir(worker.archive_dir, topic, earlier)
        blocked.parent.mkdir(parents=True, exist_ok=True)
        blocked.write_text("a file where the hour folder must go")
        for i, stamp in zip(range(3, 8), (earlier, earlier, earlier, now, now)):
            raw.produce(topic, _feedback_bytes(i), b"conv-fb", timestamp=stamp)
        raw.flush(10)
        assert wait_exit(worker) == EXIT_INFRASTRUCTURE, worker.tail()
        assert "archive write: still failing" in worker.log.read_text()

        blocked.unlink()
        worker.start()
        tap = Tap(kafka, "chat.feedback")
        expected = {(m.topic(), m.partition(), m.offset()) for m in tap.messages(8)}
        tap.close()
        archived: Counter = Counter()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            archived = Counter((m.topic, m.partition, m.offset)
                               for p in (worker.archive_dir / topic).rglob("*.avro") for m in read_messages(p))
            if set(archived) >= expected:
                break
            time.sleep(0.5)
        assert set(archived) == expected and set(archived.values()) == {1}, archived
        hours = {p.parent.name for p in (worker.archive_dir / topic).rglob("*.avro")}
        assert f"hour={datetime.fromtimestamp(earlier / 1000, tz=timezone.utc):%H}" in hours
        assert worker.stop() == 0, worker.tail()
    finally:
        if worker.proc is not None and worker.proc.poll() is None:
            worker.proc.kill()
            worker.proc.wait()
