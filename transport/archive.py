"""The Avro archive of Kafka topics: its layout (a contract), its writer and a reader for tools.

Written by the streams archiver (``streams/archive.py``), read by ``spark_jobs`` (``sources.py``);
it lives in ``transport`` so both can use it without depending on each other. Pure Python
(fastavro): no Kafka client, no pyspark.

Layout, one folder per topic and UTC hour of the Kafka record timestamp::

    <root>/<topic>/date=YYYY-MM-DD/hour=HH/part-<partition>-<first offset>-<last offset>.avro

- ``<topic>`` is the real Kafka topic name (with the deployment's prefix).
- Each file is an Avro object container file (deflate codec) of ``ArchivedMessage`` records
  (schema below): the Kafka message exactly as it was on the broker (value bytes still
  single-object-encoded Avro, key, headers) plus its topic, partition, offset and timestamp.
  Keeping the raw bytes makes the archive lossless across schema versions and lets readers
  decode it exactly as they decode Kafka; it is what Spark's Kafka source yields, so one
  decoding path serves both.
- A file holds a **run** of messages of one partition and one hour: consecutive in offset
  order among the messages written together, so a batch whose timestamps go back and forth
  across an hour boundary makes one file per run, not one per hour. Its name says exactly what
  it covers: every archived message of that partition with an offset in ``[first, last]`` is in
  this file (offsets in between that are not in it do not exist on the topic, or were archived
  by an earlier write). That is what lets the archiver know, from the names alone, which offsets
  are archived, with no scan of the contents (``parse_file_name``). A rewrite of the same offsets
  lands on the same name (idempotent re-archiving after a crash).
- Files are written in offset order, each atomically: to ``.<name>.tmp`` in the same folder
  (Spark and Hadoop skip names starting with ``.`` or ``_``), flushed and fsynced, renamed, and
  the folder fsynced (so the rename itself survives a power cut; a new ``date=``/``hour=``
  folder is fsynced into its parent the same way). A reader never sees a partial file, and a
  crash between two files of a write leaves the earlier offsets archived, the later ones not.

The ``date=``/``hour=`` names are Hive-style partition folders, so Spark prunes by time range.

Not here: when to write (batching, skipping already-archived offsets after a restart, dropping a
record repeated under the same event id): that is the archiver's job (``streams/archive.py``).
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from fastavro import parse_schema, reader, writer

ARCHIVED_MESSAGE_SCHEMA = {
    "type": "record",
    "name": "ArchivedMessage",
    "namespace": "dev.chatpipe.archive",
    "doc": "One Kafka message as it was on the broker.",
    "fields": [
        {"name": "topic", "type": "string"},
        {"name": "partition", "type": "int"},
        {"name": "offset", "type": "long"},
        {"name": "timestamp", "type": "long", "doc": "Kafka record timestamp, epoch ms"},
        {"name": "key", "type": ["null", "bytes"], "default": None},
        {"name": "value", "type": ["null", "bytes"], "default": None},
        {"name": "headers", "default": [], "type": {"type": "array", "items": {
            "type": "record", "name": "ArchivedHeader",
            "fields": [{"name": "key", "type": "string"}, {"name": "value", "type": ["null", "bytes"]}],
        }}},
    ],
}
_PARSED = parse_schema(ARCHIVED_MESSAGE_SCHEMA)


@dataclass(frozen=True, slots=True)
class ArchivedMessage:
    topic: str
    partition: int
    offset: int
    timestamp: int  # epoch ms
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...] = field(default=())


def hour_dir(root: Path, topic: str, timestamp_ms: int) -> Path:
    """The folder that holds messages of ``topic`` with this Kafka timestamp."""
    t = datetime.fromtimestamp(timestamp_ms / 1000, tz=timezone.utc)
    return Path(root) / topic / f"date={t:%Y-%m-%d}" / f"hour={t:%H}"


def file_name(partition: int, first_offset: int, last_offset: int) -> str:
    return f"part-{partition:05d}-{first_offset:020d}-{last_offset:020d}.avro"


_FILE_NAME = re.compile(r"^part-(\d+)-(\d+)-(\d+)\.avro$")


def parse_file_name(name: str) -> tuple[int, int, int] | None:
    """(partition, first offset, last offset) of an archive file name; None for any other name."""
    match = _FILE_NAME.match(name)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3]))


def plan_files(root: Path, messages: Iterable[ArchivedMessage],
               also_covers: Iterable[ArchivedMessage] = ()) -> list[tuple[Path, list[ArchivedMessage]]]:
    """The files ``messages`` make, in the order to write them: per (topic, partition) by offset,
    one file per run of consecutive messages in one hour folder.

    ``also_covers``: messages deliberately not archived (a record repeated under an event id the
    archive holds); each widens the name of the run around it, so the names still say which
    offsets need no archiving. One before every written message of its partition widens the
    first run; one with no run at all is not covered.
    """
    by_partition: dict[tuple[str, int], list[tuple[int, ArchivedMessage | None]]] = defaultdict(list)
    for m in messages:
        by_partition[(m.topic, m.partition)].append((m.offset, m))
    for m in also_covers:
        by_partition[(m.topic, m.partition)].append((m.offset, None))
    files: list[tuple[Path, list[ArchivedMessage]]] = []
    for (topic, partition), items in sorted(by_partition.items()):
        items.sort(key=lambda item: item[0])
        runs: list[list] = []  # [folder, messages, first offset, last offset]
        leading: int | None = None  # an uncovered offset before the first run
        for offset, m in items:
            if m is None:
                if runs:
                    runs[-1][3] = offset
                elif leading is None:
                    leading = offset
                continue
            folder = hour_dir(root, topic, m.timestamp)
            if runs and runs[-1][0] == folder:
                runs[-1][1].append(m)
                runs[-1][3] = offset
            else:
                first = leading if not runs and leading is not None else offset
                runs.append([folder, [m], first, offset])
        files.extend((folder / file_name(partition, first, last), group) for folder, group, first, last in runs)
    return files


def write_messages(root: Path, messages: Iterable[ArchivedMessage]) -> list[Path]:
    """Archive ``messages`` (any topics, partitions, hours); returns the files written, in order."""
    written = []
    for path, group in plan_files(root, messages):
        write_file(path, group)
        written.append(path)
    return written


def write_file(path: Path, group: list[ArchivedMessage]) -> None:
    """One archive file, atomically and durably (its folder entry included). On an error nothing
    is left at ``path`` that was not there before, and the temporary file is removed."""
    _make_dirs(path.parent)
    tmp = path.with_name(f".{path.name}.tmp")
    rows = (
        {"topic": m.topic, "partition": m.partition, "offset": m.offset, "timestamp": m.timestamp,
         "key": m.key, "value": m.value,
         "headers": [{"key": k, "value": v} for k, v in m.headers]}
        for m in group
    )
    try:
        with open(tmp, "wb") as fh:
            writer(fh, _PARSED, rows, codec="deflate", sync_interval=1 << 20)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. ENOSPC halfway: do not leave the half-file filling the disk
        raise
    _fsync_dir(path.parent)  # the rename is durable only once the folder is


def _make_dirs(folder: Path) -> None:
    """``mkdir -p`` that fsyncs each new folder's parent, so the new entry is durable too."""
    missing = []
    while not folder.is_dir():
        missing.append(folder)
        folder = folder.parent
    for new in reversed(missing):
        new.mkdir(exist_ok=True)
        _fsync_dir(new.parent)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_messages(path: Path) -> list[ArchivedMessage]:
    """The messages of one archive file (for tests and tools; Spark reads the folders itself)."""
    with open(path, "rb") as fh:
        return [
            ArchivedMessage(r["topic"], r["partition"], r["offset"], r["timestamp"], r["key"],
                            r["value"], tuple((h["key"], h["value"]) for h in r["headers"]))
            for r in reader(fh)
        ]
