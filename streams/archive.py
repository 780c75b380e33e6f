"""The archive agent and its writer: ``chat.turns`` and ``chat.feedback`` into the Avro archive.

The layout and the file writer are ``transport/archive.py`` (the contract ``spark_jobs`` reads):
per (topic, partition), one file per run of consecutive messages in one UTC hour, written in
offset order, each to a dot-file, fsynced, renamed, its folder fsynced. What this adds:

- **Every offset once.** After a crash or an exit Faust redelivers from the last commit, in
  batches that need not match the earlier ones. The archiver knows which offsets are archived
  from the file names alone (a name covers exactly its offsets), merged into ranges per
  (topic, partition), read once on the first message of that partition, and skips any offset
  they cover. ``high_water`` is the contiguous mark: the last offset of the unbroken range from
  the first archived one; the lowest offset not yet written is the one after it.
- **Every record once.** A turn repeated on ``chat.turns`` (the record agent re-emits the same
  turn, same ``event_id``, when it is stopped between sending it and committing the response)
  is a second message at another offset. The archiver drops a message whose record's
  ``event_id`` it archived lately on the same partition (the repeat has the same key, so the
  same partition): the last ``dedupe_window`` ids per partition, read back from the newest files
  after a restart. The dropped offset is covered by the name of the file around it.
- **Nothing of an erased user.** A turn or a feedback of a user (or conversation) a
  ``Deletion`` erased, created at or before it, that arrives after the deletion (archive lag)
  is not archived (``ErasureRegistry``); its offset is covered by the file around it, like a
  repeat. ``erase`` rewrites the files already written (``archive_erasure.py``). Writes and
  rewrites take one lock (``Archiver.lock``; an erasure per file it rewrites, not for its whole
  pass): the archive agent writes from one thread, the forget agent rewrites from another, and
  an erasure must not miss a file written meanwhile.
- **Nothing acked unwritten.** The agent acks a batch only after its files are renamed; a write
  error (disk full, folder unwritable) is retried for ``archive_retry_budget_s``, then the
  batch stays unacked and the process exits (``faults.py``). A retry writes only what the
  failed attempt had not renamed yet.

No Faust here: ``ArchiveAgent.handle`` takes a batch's messages (``streams/ports.py``); the Faust agent
that feeds it is ``faust_runtime.agents.faust_agent``.

Not here: undecodable messages are archived as they are (the archive keeps what the topic had).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Collection, Iterable, Sequence

from schemas.codec import AvroCodec, default_codec
from schemas.errors import DecodeError
from streams.archive_erasure import ArchiveErasure, erase_from_archive
from streams.dead_letters import event_headers
from streams.erasures import ErasureRegistry, Subject
from streams.faults import Retrier
from streams.ports import BatchRule, Message, Outbox
from transport import tracing
from transport.spans import Tracer
from transport.archive import (
    ArchivedMessage,
    file_name,
    hour_dir,
    parse_file_name,
    plan_files,
    read_messages,
    write_file,
)

log = logging.getLogger(__name__)


class ArchivedOffsets:
    """The archived offsets of one (topic, partition) as sorted, merged [first, last] ranges."""

    def __init__(self) -> None:
        self.ranges: list[list[int]] = []

    def add(self, first: int, last: int) -> None:
        i = bisect.bisect_left(self.ranges, [first, last])
        self.ranges.insert(i, [first, last])
        merged: list[list[int]] = []
        for r in self.ranges:  # few ranges: one, plus a hole or two left by a crash
            if merged and r[0] <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], r[1])
            else:
                merged.append(r)
        self.ranges = merged

    def covers(self, offset: int) -> bool:
        i = bisect.bisect_right(self.ranges, [offset, float("inf")]) - 1
        return i >= 0 and self.ranges[i][0] <= offset <= self.ranges[i][1]

    @property
    def high_water(self) -> int:
        """Last offset of the unbroken run from the first archived offset (-1 when none)."""
        return self.ranges[0][1] if self.ranges else -1


class RecentIds:
    """The last ``window`` event ids archived on one partition, oldest first."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, event_id: str) -> bool:
        return event_id in self._ids

    def add(self, event_id: str) -> None:
        self._ids[event_id] = None
        self._ids.move_to_end(event_id)
        while len(self._ids) > self.window:
            self._ids.popitem(last=False)


class Archiver:
    def __init__(self, root: Path, codec: AvroCodec | None = None, dedupe_window: int = 10_000,
                 erasures: ErasureRegistry | None = None) -> None:
        self.root = Path(root)
        self.codec = codec or default_codec()
        self.dedupe_window = dedupe_window
        self.erasures = erasures if erasures is not None else ErasureRegistry()
        # Held by every write and every erasure: they touch the same folders from two threads.
        self.lock = threading.Lock()
        self.erased = 0  # records not archived because a deletion had erased their user or conversation
        self._offsets: dict[tuple[str, int], ArchivedOffsets] = {}
        self._recent: dict[tuple[str, int], RecentIds] = {}
        self.archived = 0
        self.skipped = 0  # offsets already archived (a redelivery)
        self.duplicates = 0  # records whose event id was already archived (a repeat at a new offset)

    def write(self, messages: Iterable[ArchivedMessage]) -> list[Path]:
        """Archive what of ``messages`` is not archived yet; returns the files written."""
        with self.lock:
            return self._write(messages)

    def erase(self, topics: Iterable[str], subject: Subject, until_ms: int,
              partitions: Collection[int] | None = None) -> ArchiveErasure:
        """Remove the subject's records created at or before ``until_ms`` from the files of ``topics``
        (of ``partitions`` only, when given: the partitions this worker owns)."""
        # The lock once to list the files, then per file rewritten (archive_erasure.py says why that is enough).
        return erase_from_archive(self.root, topics, subject, until_ms, self.codec, lock=lambda: self.lock,
                                  partitions=partitions)

    def _write(self, messages: Iterable[ArchivedMessage]) -> list[Path]:
        fresh, repeats, erased_only = [], [], []
        ids: dict[tuple[str, int, int], str | None] = {}  # (topic, partition, offset) -> event id
        batch_ids: set[tuple[str, int, str]] = set()
        for m in messages:
            if self._archived(m.topic, m.partition).covers(m.offset):
                self.skipped += 1
                continue
            record = self._record(m)
            if record is not None and self.erasures.erases_record(record):
                repeats.append(m)  # not archived; its offset is covered by the file around it
                erased_only.append(m)
                continue
            event_id = ids[(m.topic, m.partition, m.offset)] = getattr(record, "event_id", None)
            key = (m.topic, m.partition, event_id)
            if event_id is not None and (event_id in self._recent_ids(m.topic, m.partition) or key in batch_ids):
                repeats.append(m)
                continue
            batch_ids.add(key)
            fresh.append(m)
        written = []
        for path, group in plan_files(self.root, fresh, also_covers=repeats):
            write_file(path, group)  # an error here leaves the earlier files written and known
            _, first, last = parse_file_name(path.name)
            topic, partition = group[0].topic, group[0].partition
            self._archived(topic, partition).add(first, last)
            recent = self._recent_ids(topic, partition)
            for m in group:
                if (event_id := ids[(topic, partition, m.offset)]) is not None:
                    recent.add(event_id)
            self.archived += len(group)
            written.append(path)
        written.extend(self._cover_erased(erased_only, {(m.topic, m.partition) for m in fresh}))
        erased = len(erased_only)
        self.duplicates += len(repeats) - erased
        self.erased += erased
        if len(repeats) > erased:
            log.info("archive: %d record(s) repeated under an event id already archived, not archived again",
                     len(repeats) - erased)
        if erased:
            log.info("archive: %d record(s) of an erased user or conversation not archived", erased)
        return written

    def _cover_erased(self, erased: list[ArchivedMessage], written: set[tuple[str, int]]) -> list[Path]:
        """An empty file per partition whose messages of this write were all erased: its name covers
        their offsets, so they are skipped when redelivered instead of judged again."""
        by_partition: dict[tuple[str, int], list[ArchivedMessage]] = {}
        for m in erased:
            if (m.topic, m.partition) not in written:
                by_partition.setdefault((m.topic, m.partition), []).append(m)
        paths = []
        for (topic, partition), group in sorted(by_partition.items()):
            first, last = min(m.offset for m in group), max(m.offset for m in group)
            path = hour_dir(self.root, topic, group[0].timestamp) / file_name(partition, first, last)
            write_file(path, [])
            self._archived(topic, partition).add(first, last)
            paths.append(path)
        return paths

    def _record(self, m: ArchivedMessage) -> object | None:
        if m.value is None:
            return None
        try:
            return self.codec.decode(m.value)
        except DecodeError:
            return None  # not a chatpipe record: archived as it is

    def _files(self, topic: str, partition: int) -> list[tuple[int, int, Path]]:
        paths = (self.root / topic).glob(f"date=*/hour=*/part-{partition:05d}-*.avro")
        return sorted((name[1], name[2], path) for path in paths if (name := parse_file_name(path.name)) is not None)

    def _archived(self, topic: str, partition: int) -> ArchivedOffsets:
        key = (topic, partition)
        if key not in self._offsets:
            offsets = ArchivedOffsets()
            for first, last, _ in self._files(topic, partition):
                offsets.add(first, last)
            if len(offsets.ranges) > 1:
                log.warning("archive of %s[%d]: offsets after %d are archived only in part (ranges %s); the "
                            "missing ones are archived when they are read again", topic, partition,
                            offsets.high_water, offsets.ranges[:5])
            self._offsets[key] = offsets
        return self._offsets[key]

    def _recent_ids(self, topic: str, partition: int) -> RecentIds:
        key = (topic, partition)
        if key not in self._recent:
            ids: list[str] = []
            for _, _, path in reversed(self._files(topic, partition)):  # newest first
                if len(ids) >= self.dedupe_window:
                    break
                ids.extend(reversed([e for m in read_messages(path)
                                     if (e := getattr(self._record(m), "event_id", None)) is not None]))
            recent = RecentIds(self.dedupe_window)
            for event_id in reversed(ids[:self.dedupe_window]):
                recent.add(event_id)
            self._recent[key] = recent
        return self._recent[key]


def archived_message(m: Message) -> ArchivedMessage:
    """A consumed message as the archive keeps it (raw bytes)."""
    # Faust hands the record timestamp as float seconds; the archive keeps Kafka's epoch ms.
    return ArchivedMessage(m.topic, m.partition, m.offset, round(m.timestamp * 1000), m.key, m.value,
                           tuple(event_headers(m)))


class ArchiveAgent:
    def __init__(self, archiver: Archiver, batch_size: int, flush_s: float, retrier: Retrier,
                 tracer: Tracer | None = None, group: str | None = None) -> None:
        self.archiver = archiver
        self.retrier = retrier
        self.tracer = tracer  # a "process <topic>" span per archived record, child of its producer span
        self.group = group
        self.batching = BatchRule(batch_size, flush_s)

    async def handle(self, consumed: Sequence[Message], outbox: Outbox) -> None:
        """Archive the batch; returns once every file is renamed (the batch is acked only then). Sends nothing."""
        start_ns = time.time_ns()
        messages = [archived_message(m) for m in consumed]
        # fsync and deflate off the event loop
        paths = await self.retrier.call("archive write", asyncio.to_thread, self.archiver.write, messages)
        if self.tracer is not None:
            self._spans(messages, len(paths), start_ns)
        log.debug("archived %d messages in %d files", len(messages), len(paths))

    def _spans(self, messages: list[ArchivedMessage], files: int, start_ns: int) -> None:
        ended_ns = time.time_ns()
        attributes = {"chatpipe.batch.size": len(messages), "chatpipe.archive.files": files}
        for m in messages:
            self.tracer.process(m.topic, tracing.find(list(m.headers)), group=self.group, partition=m.partition,
                                offset=m.offset, start_ns=start_ns, attributes=attributes).end(ended_ns)
