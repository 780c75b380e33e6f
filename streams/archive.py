"""The archive agent's writer: ``chat.turns`` and ``chat.feedback`` into the Avro archive.

The layout and the file writer are ``transport/archive.py`` (the contract ``spark_jobs``
reads): one file per (topic, partition, UTC hour) per write, written to a dot-file, fsynced
and renamed. What this adds is exactly-once per offset across restarts: Faust commits offsets
a little after a batch is written, so after a crash some messages come again. The archiver
keeps, per (topic, partition), the highest offset already archived (read once from the file
names, ``part-<partition>-<first>-<last>.avro``, on the first message of that partition) and
skips anything at or below it, so no message is archived twice and none is lost.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Iterable

from streams.dead_letters import event_headers
from transport.archive import ArchivedMessage, write_messages

log = logging.getLogger(__name__)
_PART = re.compile(r"^part-(\d+)-(\d+)-(\d+)\.avro$")


class Archiver:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._high_water: dict[tuple[str, int], int] = {}
        self.archived = 0
        self.skipped = 0

    def high_water(self, topic: str, partition: int) -> int:
        """Highest offset of ``topic``/``partition`` already in the archive (-1 if none)."""
        key = (topic, partition)
        if key not in self._high_water:
            last = -1
            for path in (self.root / topic).glob(f"date=*/hour=*/part-{partition:05d}-*.avro"):
                match = _PART.match(path.name)
                if match:
                    last = max(last, int(match[3]))
            self._high_water[key] = last
        return self._high_water[key]

    def write(self, messages: Iterable[ArchivedMessage]) -> list[Path]:
        fresh = []
        for m in messages:
            if m.offset > self.high_water(m.topic, m.partition):
                fresh.append(m)
            else:
                self.skipped += 1
        if not fresh:
            return []
        written = write_messages(self.root, fresh)
        for m in fresh:
            key = (m.topic, m.partition)
            self._high_water[key] = max(self._high_water[key], m.offset)
        self.archived += len(fresh)
        return written


def archived_message(event: Any) -> ArchivedMessage:
    """The Kafka message behind a Faust event, as the archive keeps it (raw bytes)."""
    m = event.message
    # Faust hands the record timestamp as float seconds; the archive keeps Kafka's epoch ms.
    return ArchivedMessage(m.topic, m.partition, m.offset, round(m.timestamp * 1000), m.key, m.value,
                           tuple(event_headers(m)))


class ArchiveAgent:
    def __init__(self, archiver: Archiver, batch_size: int, flush_s: float) -> None:
        self.archiver = archiver
        self.batch_size = batch_size
        self.flush_s = flush_s

    async def __call__(self, stream: Any) -> None:
        import asyncio

        async for events in stream.take_events(self.batch_size, self.flush_s):
            messages = [archived_message(e) for e in events]
            # fsync and deflate off the event loop; events are acked (committed) only after this returns.
            paths = await asyncio.to_thread(self.archiver.write, messages)
            log.debug("archived %d messages in %d files", len(messages), len(paths))
