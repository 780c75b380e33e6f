"""The archiver: every offset once and every record once across crashes and restarts, durable files,
and the archive layout's contract (real Archiver and writer on a temporary folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

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


# --- faults between, during and after writes ---------------------------------------------------------


class Crash(Exception):
    """The process dying at this point (the next Archiver is the restarted process)."""


def crash_on_rename(monkeypatch, nth: int) -> None:
    """The ``nth`` rename of this write (1-based) never happens: the process died just before it."""
    import transport.archive as layout

    real, calls = layout.os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == nth:
            raise Crash(f"killed before renaming {dst}")
        real(src, dst)

    monkeypatch.setattr(layout.os, "replace", replace)


def test_a_crash_between_two_files_with_timestamps_out_of_order_loses_no_offset(tmp_path, monkeypatch):
    """Guards the max-offset high-water mark: offset 10 stamped in hour 2 and offset 11 in hour 1 made two
    files; the hour-1 file (offset 11) was written first, the process died before the other, and the
    restart skipped everything <= 11, so offset 10 was never archived."""
    batch = [msg(10, ts=T0 + HOUR_MS), msg(11, ts=T0)]
    crash_on_rename(monkeypatch, 2)
    with pytest.raises(Crash):
        Archiver(tmp_path).write(batch)
    monkeypatch.undo()
    restarted = Archiver(tmp_path)
    restarted.write(batch)  # Faust redelivers the unacked batch
    assert archived(tmp_path) == [("p.chat.turns", 0, 10), ("p.chat.turns", 0, 11)]
    assert restarted._archived("p.chat.turns", 0).high_water == 11


def test_a_hole_below_the_highest_archived_offset_is_filled_and_the_high_water_mark_is_contiguous(tmp_path):
    """Guards the restart position: an archive where 11..12 are written but 10 is not (left by a crash of
    the former writer, which wrote by hour) must archive 10 when it comes again, and never 11..12 twice."""
    from transport.archive import write_messages

    Archiver(tmp_path).write([msg(o) for o in range(0, 10)])
    write_messages(tmp_path, [msg(11), msg(12)])
    restarted = Archiver(tmp_path)
    assert restarted._archived("p.chat.turns", 0).high_water == 9, "the lowest offset not yet written is 10"
    restarted.write([msg(o) for o in range(10, 14)])
    assert archived(tmp_path) == [("p.chat.turns", 0, o) for o in range(14)]
    assert restarted._archived("p.chat.turns", 0).high_water == 13 and restarted.skipped == 2


def test_files_follow_offsets_so_a_crash_leaves_a_prefix_archived(tmp_path, monkeypatch):
    """Timestamps going back and forth across an hour make one file per run, written in offset order: a
    crash after the first file leaves offsets 0..1 archived and nothing above them."""
    batch = [msg(0), msg(1), msg(2, ts=T0 + HOUR_MS), msg(3), msg(4, ts=T0 + HOUR_MS)]
    crash_on_rename(monkeypatch, 2)
    with pytest.raises(Crash):
        Archiver(tmp_path).write(batch)
    monkeypatch.undo()
    assert archived(tmp_path) == [("p.chat.turns", 0, 0), ("p.chat.turns", 0, 1)]
    Archiver(tmp_path).write(batch)
    names = sorted(p.name for p in tmp_path.rglob("*.avro"))
    assert len(names) == 4 and archived(tmp_path) == [("p.chat.turns", 0, o) for o in range(5)]


def test_the_folder_is_fsynced_after_the_rename(tmp_path, monkeypatch):
    """Guards durability: a rename is only on disk once its folder is fsynced; without that a power cut
    can lose a file whose offsets were already committed (acked) as archived."""
    import os

    import transport.archive as layout

    events: list[tuple[str, str]] = []
    real_replace, real_fsync = layout.os.replace, layout.os.fsync

    def replace(src, dst):
        real_replace(src, dst)
        events.append(("rename", str(Path(dst).parent)))

    def fsync(fd):
        real_fsync(fd)
        target = os.readlink(f"/proc/self/fd/{fd}")
        events.append(("fsync-dir" if os.path.isdir(target) else "fsync-file", target))

    monkeypatch.setattr(layout.os, "replace", replace)
    monkeypatch.setattr(layout.os, "fsync", fsync)
    (path,) = Archiver(tmp_path).write([msg(0)])
    renamed = events.index(("rename", str(path.parent)))
    assert ("fsync-dir", str(path.parent)) in events[renamed + 1:], events
    assert events[renamed - 1][0] == "fsync-file", "the file's bytes are synced before it is renamed"
    # the new date=/hour= folders are made durable in their parents as well
    assert ("fsync-dir", str(path.parent.parent)) in events and ("fsync-dir", str(tmp_path / "p.chat.turns")) in events


def test_a_write_error_leaves_no_temporary_file_and_the_retry_writes_only_the_rest(tmp_path, monkeypatch):
    """A disk error on the second file (ENOSPC) must not leave a half-written dot-file filling the disk,
    and the agent's retry must not archive the first file's offsets again."""
    import errno

    import transport.archive as layout

    archiver = Archiver(tmp_path)
    batch = [msg(0), msg(1, ts=T0 + HOUR_MS)]
    real_replace, calls = layout.os.replace, []

    def full(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(layout.os, "replace", full)
    with pytest.raises(OSError):
        archiver.write(batch)
    assert not [p for p in tmp_path.rglob(".*") if p.is_file()]
    monkeypatch.undo()
    archiver.write(batch)
    assert archived(tmp_path) == [("p.chat.turns", 0, 0), ("p.chat.turns", 0, 1)]
    assert archiver.archived == 2


# --- one record once, whatever offset it came at --------------------------------------------------


def turn_msg(offset: int, request_id: str, partition: int = 0) -> ArchivedMessage:
    from schemas.codec import default_codec
    from schemas.records import ConversationTurn, FinishReason
    from streams.record import turn_id_for

    turn = ConversationTurn(event_id=turn_id_for(request_id), conversation_id="c1", user_id="u1", tenant="acme",
                            request_id=request_id, turn_index=0, prompt="hi", answer="hello", model="m",
                            worker_id="w", tokens_in=3, tokens_out=1, queue_ms=1.0, total_ms=2.0,
                            finish_reason=FinishReason.STOP, created_at=T0, completed_at=T0 + 5)
    return ArchivedMessage("p.chat.turns", partition, offset, T0 + offset, b"c1", default_codec().encode(turn), ())


def archived_requests(root: Path) -> list[str]:
    from schemas.codec import default_codec

    codec = default_codec()
    return sorted(codec.decode(m.value).request_id for p in root.rglob("*.avro") for m in read_messages(p))


def test_a_turn_emitted_again_at_a_new_offset_is_archived_once_across_restarts(tmp_path):
    """Guards 'every answered turn in the archive exactly once': the record agent stopped between sending a
    turn and committing its response sends the same turn (same event_id) again at a later offset."""
    Archiver(tmp_path).write([turn_msg(0, "r0"), turn_msg(1, "r1"), turn_msg(2, "r2")])
    restarted = Archiver(tmp_path)  # knows the event ids from the newest files
    restarted.write([turn_msg(3, "r1"), turn_msg(4, "r3"), turn_msg(5, "r3")])
    assert archived_requests(tmp_path) == ["r0", "r1", "r2", "r3"]
    assert restarted.duplicates == 2
    # the dropped repeats are covered by the file names: redelivered, they are skipped, not re-judged
    again = Archiver(tmp_path, dedupe_window=1)
    assert again._archived("p.chat.turns", 0).high_water == 5
    again.write([turn_msg(o, r) for o, r in ((3, "r1"), (4, "r3"), (5, "r3"))])
    assert again.skipped == 3 and archived_requests(tmp_path) == ["r0", "r1", "r2", "r3"]


def test_undecodable_messages_are_archived_as_they_are(tmp_path):
    """The archive keeps what the topic had: a poison record has no event id and is never dropped."""
    archiver = Archiver(tmp_path)
    archiver.write([msg(0), msg(1)])
    assert archived(tmp_path) == [("p.chat.turns", 0, 0), ("p.chat.turns", 0, 1)] and archiver.duplicates == 0
