"""Erasing a user (or one conversation) from the Avro archive: the affected files rewritten.

Design: rewrite, not crypto-shredding. The archive's files are raw Kafka messages that Spark
reads directly (``transport/archive.py``); per-user encryption would need every reader to hold
keys and decrypt, and a key store of its own to erase from. A rewrite keeps the layout as it is
and costs a pass over the archive per deletion (``bench/erasure.py`` measures it against a plain
copy of the same files).

What a rewrite does, per file of the topics given (``chat.turns``, ``chat.feedback``; never
``chat.deletions``, whose log is the source of truth):

1. a message can belong to the subject only if the user id's bytes occur in its value (Avro
   strings are stored as raw utf-8): a file none of whose (decompressed) Avro blocks holds those
   bytes is passed over without parsing a record (5x cheaper than reading it); in the others,
   only the messages holding them are decoded;
2. a message whose record is of that tenant and user (and conversation), created at or before
   the deletion, is dropped;
3. when something was dropped, the rest is written to ``.<name>.tmp`` in the same folder,
   fsynced, renamed over the file, and the folder fsynced (``transport.archive.write_file``): a
   reader sees the old file or the new one, never half of one; a crash leaves one of the two.

The file keeps its name even when nothing is left in it (an empty Avro file): the name says
which offsets are archived, so a redelivery does not archive the erased messages again. A repeat
of the same erasure finds nothing and rewrites nothing (idempotent: the forget agent may carry a
deletion out twice after a restart).

Locking (``Archiver.erase``): the archive agent writes new files into the same folders from
another thread. The erasure takes the archiver's lock once before it lists the files (a write in
progress then finishes, and every later write checks the erasure registry, which already holds
the deletion), then once per file it rewrites, so the archive agent waits at most one file's
rewrite, not the whole pass. A write never touches an existing file (new offsets, new names), so
the two never race on one file.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Collection, ContextManager, Iterable

from fastavro import block_reader

from schemas.codec import AvroCodec
from schemas.errors import DecodeError
from streams.erasures import Subject
from transport.archive import ArchivedMessage, parse_file_name, read_messages, write_file

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ArchiveErasure:
    """What one erasure found and did."""

    files_scanned: int = 0
    files_rewritten: int = 0
    records_removed: int = 0
    conversations: set[str] = field(default_factory=set)  # conversation ids whose records were removed
    seconds: float = 0.0


def archive_files(root: Path, topic: str, partitions: Collection[int] | None = None) -> list[Path]:
    """Every archive file of ``topic`` (hour folders in time order, then by name); with ``partitions``,
    only the files of those partitions (a streams worker erases the partitions it owns)."""
    named = ((p, parse_file_name(p.name)) for p in (Path(root) / topic).glob("date=*/hour=*/*.avro"))
    return sorted(p for p, name in named if name and (partitions is None or name[0] in partitions))


def may_hold(path: Path, needle: bytes) -> bool:
    """Whether any Avro block of the file contains ``needle`` (blocks decompressed, no record parsed)."""
    with open(path, "rb") as fh:
        return any(needle in block.bytes_.getvalue() for block in block_reader(fh))


def subject_record(value: bytes | None, subject: Subject, until_ms: int, codec: AvroCodec,
                   needle: bytes) -> object | None:
    """The decoded record when ``value`` is one of the subject's, created at or before ``until_ms``."""
    if value is None or needle not in value:  # cheap: most messages are somebody else's
        return None
    try:
        record = codec.decode(value)
    except DecodeError:
        return None  # not a chatpipe record: archived as it was, nobody's
    try:
        ours = subject.covers(record.tenant, record.user_id, record.conversation_id)
        created = record.created_at
    except AttributeError:
        return None
    return record if ours and created <= until_ms else None


def erase_from_files(files: Iterable[Path], subject: Subject, until_ms: int, codec: AvroCodec,
                     progress: Callable[[int], None] | None = None,
                     lock: Callable[[], ContextManager] = contextlib.nullcontext) -> ArchiveErasure:
    """Drop the subject's records from ``files``, rewriting each affected file atomically
    (``lock()`` is held while one file is read and rewritten)."""
    started = time.perf_counter()
    result = ArchiveErasure()
    needle = subject.user_id.encode()
    for path in files:
        result.files_scanned += 1
        if progress is not None and result.files_scanned % 500 == 0:
            progress(result.files_scanned)
        try:
            if not may_hold(path, needle):
                continue
            with lock():
                messages = read_messages(path)
                kept: list[ArchivedMessage] = []
                for m in messages:
                    record = subject_record(m.value, subject, until_ms, codec, needle)
                    if record is None:
                        kept.append(m)
                    else:
                        result.conversations.add(record.conversation_id)
                removed = len(messages) - len(kept)
                if removed:
                    write_file(path, kept)  # tmp + fsync + rename + folder fsync; the name (offsets) unchanged
        except FileNotFoundError:
            continue  # gone meanwhile (an operator pruned the archive): nothing of anybody left to erase
        if removed:
            result.files_rewritten += 1
            result.records_removed += removed
    result.seconds = time.perf_counter() - started
    return result


def erase_from_archive(root: Path, topics: Iterable[str], subject: Subject, until_ms: int, codec: AvroCodec,
                       progress: Callable[[int], None] | None = None,
                       lock: Callable[[], ContextManager] = contextlib.nullcontext,
                       partitions: Collection[int] | None = None) -> ArchiveErasure:
    """``erase_from_files`` over every file of ``topics`` under ``root`` (listed under ``lock()``), or
    only over the files of ``partitions``."""
    with lock():
        files = [p for topic in topics for p in archive_files(root, topic, partitions)]
    result = erase_from_files(files, subject, until_ms, codec, progress, lock)
    log.info("archive erasure of %s/%s%s: %d record(s) removed from %d of %d file(s) in %.3f s", subject.tenant,
             subject.user_id, f"/{subject.conversation_id}" if subject.conversation_id else "",
             result.records_removed, result.files_rewritten, result.files_scanned, result.seconds)
    return result
