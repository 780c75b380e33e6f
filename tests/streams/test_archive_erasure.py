"""Erasing a user from the Avro archive: the affected files rewritten atomically, nothing of the subject
left, nothing else touched; late records of an erased user never archived; the forget agent doing it
and auditing it (real Archiver, writer and codec on a temporary folder; the agent with stand-ins for
Faust's topic and Qdrant)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections import namedtuple
from pathlib import Path

import pytest

from schemas.codec import default_codec
from schemas.records import ConversationTurn, Deletion, DeletionAudit, DeletionScope, Feedback, FeedbackKind, FinishReason
from streams.archive import Archiver
from streams.erasures import ErasureRegistry, Subject
from transport.archive import ArchivedMessage, read_messages

HOUR_MS = 3_600_000
T0 = 1_790_000_000_000 - 1_790_000_000_000 % HOUR_MS
TURNS, FEEDBACK, DELETIONS = "p.chat.turns", "p.chat.feedback", "p.chat.deletions"
CODEC = default_codec()


def turn(offset: int, tenant: str, user: str, conversation: str, created_at: int = T0, partition: int = 0,
         ts: int | None = None) -> ArchivedMessage:
    record = ConversationTurn(conversation_id=conversation, user_id=user, tenant=tenant, request_id=f"r{offset}",
                              turn_index=offset, prompt=f"{user} says fact {offset}", answer="noted", model="m",
                              worker_id="w", tokens_in=3, tokens_out=1, queue_ms=1.0, total_ms=2.0,
                              finish_reason=FinishReason.STOP, created_at=created_at, completed_at=created_at + 5)
    return ArchivedMessage(TURNS, partition, offset, ts if ts is not None else T0 + offset, conversation.encode(),
                           CODEC.encode(record), (("traceparent", b"00-x"),))


def feedback(offset: int, tenant: str, user: str, conversation: str, created_at: int = T0) -> ArchivedMessage:
    record = Feedback(conversation_id=conversation, user_id=user, tenant=tenant, request_id=f"r{offset}",
                      kind=FeedbackKind.THUMBS_UP, created_at=created_at)
    return ArchivedMessage(FEEDBACK, 0, offset, T0 + offset, conversation.encode(), CODEC.encode(record), ())


def subjects(root: Path) -> list[tuple[str, str, str, str]]:
    """(topic, tenant, user, conversation) of every record in the archive, sorted."""
    out = []
    for path in root.rglob("*.avro"):
        for m in read_messages(path):
            r = CODEC.decode(m.value)
            out.append((m.topic, r.tenant, r.user_id, getattr(r, "conversation_id", None) or ""))
    return sorted(out)


def mixed_archive(root: Path) -> Archiver:
    """Ada (acme) in two conversations over two hours, Bob (acme), and globex's own 'ada'."""
    archiver = Archiver(root)
    archiver.write([turn(0, "acme", "ada", "c1"), turn(1, "acme", "bob", "c9"), turn(2, "acme", "ada", "c2"),
                    turn(3, "globex", "ada", "c1"), turn(4, "acme", "ada", "c1", ts=T0 + HOUR_MS),
                    feedback(0, "acme", "ada", "c1"), feedback(1, "acme", "bob", "c9")])
    return archiver


def test_a_user_erasure_removes_every_record_of_that_tenants_user_and_nothing_else(tmp_path):
    archiver = mixed_archive(tmp_path)
    names_before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.avro"))
    result = archiver.erase([TURNS, FEEDBACK], Subject("acme", "ada", None), until_ms=T0)
    assert subjects(tmp_path) == [(FEEDBACK, "acme", "bob", "c9"), (TURNS, "acme", "bob", "c9"),
                                  (TURNS, "globex", "ada", "c1")]
    assert result.records_removed == 4 and result.conversations == {"c1", "c2"}
    assert result.files_rewritten == 3 and result.files_scanned == 3  # two turn hours + one feedback file
    # the names (which say what offsets are archived) are unchanged, even of a file left empty
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.avro")) == names_before
    assert not [p for p in tmp_path.rglob(".*") if p.is_file()], "no temporary file may be left behind"
    # redelivered, the erased offsets are skipped (the names cover them), not archived again
    restarted = Archiver(tmp_path)
    restarted.write([turn(0, "acme", "ada", "c1"), turn(4, "acme", "ada", "c1", ts=T0 + HOUR_MS)])
    assert restarted.skipped == 2 and ("acme", "ada") not in {(t, u) for _, t, u, _ in subjects(tmp_path)}


def test_a_second_erasure_of_the_same_subject_rewrites_nothing(tmp_path):
    archiver = mixed_archive(tmp_path)
    archiver.erase([TURNS, FEEDBACK], Subject("acme", "ada", None), until_ms=T0)
    again = archiver.erase([TURNS, FEEDBACK], Subject("acme", "ada", None), until_ms=T0)
    assert (again.records_removed, again.files_rewritten, again.files_scanned) == (0, 0, 3)


def test_a_conversation_erasure_keeps_the_users_other_conversations(tmp_path):
    archiver = mixed_archive(tmp_path)
    archiver.erase([TURNS, FEEDBACK], Subject("acme", "ada", "c1"), until_ms=T0)
    assert [s for s in subjects(tmp_path) if s[1:3] == ("acme", "ada")] == [(TURNS, "acme", "ada", "c2")]


def test_records_created_after_the_deletion_are_kept(tmp_path):
    """A deletion erases what was made at or before it; the user may come back afterwards."""
    archiver = Archiver(tmp_path)
    archiver.write([turn(0, "acme", "ada", "c1", created_at=T0), turn(1, "acme", "ada", "c1", created_at=T0 + 1)])
    archiver.erase([TURNS], Subject("acme", "ada", None), until_ms=T0)
    assert [CODEC.decode(m.value).request_id for p in tmp_path.rglob("*.avro") for m in read_messages(p)] == ["r1"]


def test_the_rewrite_is_atomic_and_durable(tmp_path, monkeypatch):
    """The new content goes to a dot-file, is fsynced, renamed over the file, and the folder is fsynced; a
    failure at the rename leaves the old file whole and no temporary file."""
    import transport.archive as layout

    archiver = mixed_archive(tmp_path)
    (target,) = [p for p in (tmp_path / FEEDBACK).rglob("*.avro")]
    before = target.read_bytes()
    events: list[tuple[str, str]] = []
    real_replace, real_fsync = layout.os.replace, layout.os.fsync

    def replace(src, dst):
        events.append(("rename", str(Path(dst).parent)))
        real_replace(src, dst)

    def fsync(fd):
        real_fsync(fd)
        where = os.readlink(f"/proc/self/fd/{fd}")
        events.append(("fsync-dir" if os.path.isdir(where) else "fsync-file", where))

    def failing(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(layout.os, "replace", failing)
    with pytest.raises(OSError):
        archiver.erase([FEEDBACK], Subject("acme", "ada", None), until_ms=T0)
    assert target.read_bytes() == before and not [p for p in tmp_path.rglob(".*") if p.is_file()]
    monkeypatch.setattr(layout.os, "replace", replace)
    monkeypatch.setattr(layout.os, "fsync", fsync)
    archiver.erase([FEEDBACK], Subject("acme", "ada", None), until_ms=T0)
    renamed = events.index(("rename", str(target.parent)))
    assert events[renamed - 1][0] == "fsync-file" and ("fsync-dir", str(target.parent)) in events[renamed + 1:]
    assert [CODEC.decode(m.value).user_id for m in read_messages(target)] == ["bob"]


def test_late_records_of_an_erased_user_are_not_archived_and_their_offsets_are_covered(tmp_path):
    """Archive lag: turns and feedback made before the deletion reach the archive after it."""
    registry = ErasureRegistry()
    registry.add(Deletion(scope=DeletionScope.USER, tenant="acme", user_id="ada", created_at=T0 + 10))
    archiver = Archiver(tmp_path, erasures=registry)
    archiver.write([turn(0, "acme", "ada", "c1"), turn(1, "acme", "bob", "c9"), turn(2, "acme", "ada", "c2"),
                    turn(3, "acme", "ada", "c3", created_at=T0 + 11), feedback(0, "acme", "ada", "c1")])
    assert subjects(tmp_path) == [(TURNS, "acme", "ada", "c3"), (TURNS, "acme", "bob", "c9")]
    assert archiver.erased == 3 and archiver.duplicates == 0
    restarted = Archiver(tmp_path)
    assert restarted._archived(TURNS, 0).high_water == 3 and restarted._archived(FEEDBACK, 0).high_water == 0


def test_the_registry_tells_users_conversations_and_times_apart():
    registry = ErasureRegistry()
    registry.add(Deletion(scope=DeletionScope.USER, tenant="acme", user_id="ada", created_at=100))
    registry.add(Deletion(scope=DeletionScope.CONVERSATION, tenant="acme", user_id="bob", conversation_id="c1",
                          created_at=200))
    registry.add(Deletion(scope=DeletionScope.USER, tenant="acme", user_id="ada", created_at=50))  # older, re-read
    assert registry.erased("acme", "ada", "any", 100) and not registry.erased("acme", "ada", "any", 101)
    assert not registry.erased("globex", "ada", "any", 1), "another tenant's user of the same id is not erased"
    assert registry.erased("acme", "bob", "c1", 200) and not registry.erased("acme", "bob", "c2", 1)
    assert not registry.erases_record(Deletion(scope=DeletionScope.USER, tenant="acme", user_id="ada", created_at=1))


def test_an_erasure_racing_the_archive_writer_leaves_nothing_of_the_subject(tmp_path):
    """The archive agent writes from one thread while the forget agent registers and rewrites from
    another: whatever the interleaving, no record of the erased user made before the deletion stays."""
    registry = ErasureRegistry()
    archiver = Archiver(tmp_path, erasures=registry)
    stop = threading.Event()

    def archive_agent():
        offset = 0
        while not stop.is_set() and offset < 4000:
            archiver.write([turn(o, "acme", "ada" if o % 2 else "bob", "c1") for o in range(offset, offset + 50)])
            offset += 50

    writer = threading.Thread(target=archive_agent)
    writer.start()
    while not list(tmp_path.rglob("*.avro")):
        pass
    registry.add(Deletion(scope=DeletionScope.USER, tenant="acme", user_id="ada", created_at=T0))
    archiver.erase([TURNS], Subject("acme", "ada", None), until_ms=T0)
    stop.set()
    writer.join()
    users = {u for _, _, u, _ in subjects(tmp_path)}
    assert users == {"bob"}, users


# --- the forget agent ---------------------------------------------------------------------------


class FakeTopic:
    def __init__(self, name: str) -> None:
        self.name, self.sent, self.partitions = name, [], []

    def get_topic_name(self) -> str:
        return self.name

    async def send(self, *, key, value, headers, partition=None):
        self.sent.append((key, value))
        self.partitions.append(partition)
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


class FakeMemory:
    def __init__(self) -> None:
        self.forgotten = []

    def forget(self, *, tenant, user_id, conversation_id=None):
        self.forgotten.append((tenant, user_id, conversation_id))
        return 2


TP = namedtuple("TP", "topic partition")


class FakeEvent:
    def __init__(self, topic: str, offset: int, value: bytes, key: bytes, partition: int = 0) -> None:
        class Message:
            pass

        self.message = m = Message()
        m.topic, m.partition, m.offset, m.value, m.key, m.headers = topic, partition, offset, value, key, []
        m.timestamp = T0 / 1000
        m.tp = TP(topic, partition)


class FakeStream:
    def __init__(self, events) -> None:
        self.events, self.acked = events, []

    async def noack_take(self, n, within):
        yield self.events

    async def ack(self, event):
        self.acked.append(event)


def test_the_forget_agents_fan_out_erase_each_partition_audit_it_and_archive_the_deletion(tmp_path):
    """Forget sends one copy per conversation partition and archives the deletion; the step of partition
    p erases memory, the table entries of partition p only and the archive files of partition p."""
    from streams.dead_letters import DeadLetters
    from streams.faults import Retrier
    from streams.faust_runtime.agents import serve
    from streams.faust_runtime.outbox import Outbox
    from streams.forget import Forget, ForgetPartition
    from streams.services import StreamsServices
    from streams.state import state_key
    from streams.table import key_partition

    archiver = mixed_archive(tmp_path)  # every file on partition 0
    services = StreamsServices(memory=FakeMemory(), embedder=None, counter=None)
    keys = {c: state_key("acme", "ada", c) for c in ("c1", "c2", "c3", "c4")}
    table = {key: {"tenant": "acme", "user_id": "ada", "conversation_id": c} for c, key in keys.items()}
    bob = state_key("acme", "bob", "c9")
    table[bob] = {"tenant": "acme", "user_id": "bob", "conversation_id": "c9"}
    assert len({key_partition(k, 6) for k in keys.values()}) > 1, "the test needs ada's conversations on 2+ partitions"
    audits, dlq, fanout = FakeTopic("p.chat.deletions.audit"), FakeTopic("p.chat.dlq"), FakeTopic("p.app-forget")
    retrier = Retrier(5, 0.01, 0.01)
    letters = DeadLetters(dlq, CODEC, "streams.forget")
    forget = Forget(services, fanout, 6, letters, retrier, archiver=archiver)
    deletion = Deletion(scope=DeletionScope.USER, tenant="acme", user_id="ada", created_at=T0 + 1)
    stream = FakeStream([FakeEvent(DELETIONS, 0, CODEC.encode(deletion), b"acme/ada")])
    asyncio.run(serve(stream, forget, lambda: Outbox(retrier)))  # Faust's stream faked (FakeStream)
    assert len(stream.acked) == 1 and fanout.partitions == [0, 1, 2, 3, 4, 5]
    assert all(value == CODEC.encode(deletion) and key == b"acme/ada" for key, value in fanout.sent)
    assert len(table) == 5, "the fan-out itself erases nothing"
    # the deletion itself is archived under chat.deletions, and stays (never rewritten)
    (kept,) = [m for p in (tmp_path / DELETIONS).rglob("*.avro") for m in read_messages(p)]
    assert kept.key == b"acme/ada" and CODEC.decode(kept.value).event_id == deletion.event_id

    step = ForgetPartition(services, table, 6, audits, letters, retrier, archiver=archiver,
                           archive_topics=[TURNS, FEEDBACK])
    one = key_partition(keys["c1"], 6)
    asyncio.run(serve(FakeStream([FakeEvent("p.app-forget", 0, CODEC.encode(deletion), b"acme/ada", one)]), step,
                      lambda: Outbox(retrier)))
    assert keys["c1"] not in table and bob in table
    assert {k for k in keys.values() if k in table} == {k for k in keys.values() if key_partition(k, 6) != one}
    for partition in sorted(set(range(6)) - {one}):
        asyncio.run(serve(FakeStream([FakeEvent("p.app-forget", 1, CODEC.encode(deletion), b"acme/ada", partition)]),
                          step, lambda: Outbox(retrier)))
    assert list(table) == [bob]
    assert {(t, u) for topic, t, u, _ in subjects(tmp_path) if topic != DELETIONS} == {("acme", "bob"), ("globex", "ada")}
    decoded = [CODEC.decode(v) for _, v in audits.sent]
    assert all(isinstance(a, DeletionAudit) and a.deletion_event_id == deletion.event_id for a in decoded)
    forgets = [a for a in decoded if a.component == "streams.forget"]
    archives = [a for a in decoded if a.component == "streams.archive"]
    assert len(forgets) == len(archives) == 6, "one audit of each store per partition"
    assert sum(a.conversations_cleared for a in forgets) == 4
    assert sum(a.memory_points_deleted for a in forgets) == 12  # FakeMemory answers 2 per call
    assert sum(a.conversations_cleared for a in archives) == 2  # c1 and c2 held archived records (partition 0)
    # from now on a late turn of ada made before the deletion is not archived
    archiver.write([turn(10, "acme", "ada", "c5", created_at=T0)])
    assert archiver.erased == 1


def test_a_user_id_inside_another_users_id_erases_only_the_exact_user(tmp_path):
    """The byte prefilter finds 'ada' inside 'adam' and 'shop:ada' inside 'shop:adam': only decoding decides."""
    archiver = Archiver(tmp_path)
    archiver.write([turn(0, "acme", "shop:ada", "c1"), turn(1, "acme", "shop:adam", "c1"),
                    turn(2, "acme", "ada", "c1")])
    result = archiver.erase([TURNS], Subject("acme", "shop:ada", None), until_ms=T0)
    assert result.records_removed == 1
    assert sorted(u for _, _, u, _ in subjects(tmp_path)) == ["ada", "shop:adam"]
    untouched = Archiver(tmp_path / "other")
    untouched.write([turn(0, "acme", "bob", "c1")])
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "other").rglob("*.avro")}
    assert untouched.erase([TURNS], Subject("acme", "shop:ada", None), until_ms=T0).files_rewritten == 0
    assert before == {p: p.stat().st_mtime_ns for p in (tmp_path / "other").rglob("*.avro")}
