"""The archiver's exactly-once rule across restarts, and the moved archive writer's contract."""

from __future__ import annotations

from pathlib import Path

from streams.archive import Archiver
from transport.archive import ArchivedMessage, read_messages

HOUR_MS = 3_600_000
T0 = 1_790_000_000_000 - 1_790_000_000_000 % HOUR_MS  # an hour boundary


def msg(offset: int, partition: int = 0, ts: int = T0, topic: str = "p.chat.turns") -> ArchivedMessage:
    return ArchivedMessage(topic, partition, offset, ts + offset, f"k{offset}".encode(), f"v{offset}".encode(),
                           (("traceparent", b"00-x"),))


def archived(root: Path) -> list[tuple]:
    return sorted((m.topic, m.partition, m.offset) for p in root.rglob("*.avro") for m in read_messages(p))


def test_redelivered_offsets_after_a_restart_are_not_archived_twice(tmp_path):
    """Faust commits a little after a write: after a crash the same offsets come again, in other batches."""
    Archiver(tmp_path).write([msg(o) for o in range(0, 10)])
    restarted = Archiver(tmp_path)  # knows nothing but the files
    restarted.write([msg(o) for o in range(5, 15)] + [msg(3, partition=1)])
    assert archived(tmp_path) == [("p.chat.turns", 0, o) for o in range(15)] + [("p.chat.turns", 1, 3)]
    assert restarted.skipped == 5 and restarted.archived == 6


def test_files_split_by_hour_and_partition_and_read_back_byte_for_byte(tmp_path):
    messages = [msg(0), msg(1, ts=T0 + HOUR_MS), msg(2, partition=2)]
    paths = Archiver(tmp_path).write(messages)
    assert len(paths) == 3 and all(p.parent.name.startswith("hour=") for p in paths)
    back = {(m.partition, m.offset): m for p in paths for m in read_messages(p)}
    assert [back[(m.partition, m.offset)] for m in messages] == [
        ArchivedMessage(m.topic, m.partition, m.offset, m.timestamp, m.key, m.value, m.headers) for m in messages]
    assert not [p for p in tmp_path.rglob(".*") if p.is_file()], "no temporary file may remain"
