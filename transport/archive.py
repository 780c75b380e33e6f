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
- A file holds messages of one partition and one hour, in offset order. Its name makes a
  rewrite of the same offsets land on the same name (idempotent re-archiving after a crash).
- Files are written atomically: to ``.<name>.tmp`` in the same folder (Spark and Hadoop skip
  names starting with ``.`` or ``_``), flushed and fsynced, then renamed. A reader never
  sees a partial file.
- When the archiver knows an hour is complete it may write an empty ``_SEALED`` file in the
  folder; readers do not require it.

The ``date=``/``hour=`` names are Hive-style partition folders, so Spark prunes by time range.

Not here: when to write (batching, skipping already-archived offsets after a restart): that is
the archiver's job (``streams/archive.py``).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from fastavro import parse_schema, writer

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


def write_messages(root: Path, messages: Iterable[ArchivedMessage]) -> list[Path]:
    """Archive ``messages`` (any topics, partitions, hours): one atomic file per (topic, partition, hour).

    Returns the files written. Messages of one group are sorted by offset.
    """
    groups: dict[tuple[str, int, Path], list[ArchivedMessage]] = defaultdict(list)
    for m in messages:
        groups[(m.topic, m.partition, hour_dir(root, m.topic, m.timestamp))].append(m)
    written = []
    for (_topic, partition, folder), group in sorted(groups.items(), key=lambda kv: str(kv[0])):
        group.sort(key=lambda m: m.offset)
        path = folder / file_name(partition, group[0].offset, group[-1].offset)
        _write_atomically(path, group)
        written.append(path)
    return written


def seal_hour(folder: Path) -> None:
    """Mark an hour folder complete (optional for readers)."""
    (Path(folder) / "_SEALED").touch()


def _write_atomically(path: Path, group: list[ArchivedMessage]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    rows = (
        {"topic": m.topic, "partition": m.partition, "offset": m.offset, "timestamp": m.timestamp,
         "key": m.key, "value": m.value,
         "headers": [{"key": k, "value": v} for k, v in m.headers]}
        for m in group
    )
    with open(tmp, "wb") as fh:
        writer(fh, _PARSED, rows, codec="deflate", sync_interval=1 << 20)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_messages(path: Path) -> list[ArchivedMessage]:
    """The messages of one archive file (for tests and tools; Spark reads the folders itself)."""
    from fastavro import reader

    with open(path, "rb") as fh:
        return [
            ArchivedMessage(r["topic"], r["partition"], r["offset"], r["timestamp"], r["key"],
                            r["value"], tuple((h["key"], h["value"]) for h in r["headers"]))
            for r in reader(fh)
        ]
