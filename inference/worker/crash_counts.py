"""How often each record made the worker crash, kept in its partition's commit metadata. Pure Python.

A record whose handling raises an exception that no rule of the failure policy calls the record's
fault and that is no outage (``transport.failures``: FATAL, a bug) stops the worker unacked: the
exception may be the process's (a broken state a restart clears), so the record is served again
after the restart. A record that triggers a bug every time would crash-loop its partition (and every
worker that takes it over) forever. So the worker counts, per record, the crashes its own handling
raised; one taken with ``limit`` crashes behind it is dead-lettered with the last crash's reason
instead (``PoisonRecordError``), the way Kafka Streams' and Flink's poison-pill handlers skip a
record, and its partition moves on.

Where the count lives: with the partition's committed offset. Kafka keeps a metadata string beside
every committed offset of a group (``offset.metadata.max.bytes``, 4096 by default); the partition's
owner writes it with every commit and whoever owns the partition next reads it with the offset. So
the count survives the crash, a restart and a move to another worker, and needs no store of its
own; a record past the committed position is finished and its entry is dropped with the next commit.
Share groups count deliveries themselves (``max_delivery_attempts``); this is partition mode's.

Attribution: only an exception raised by one record's own handling counts, against that record, so
a poison record's neighbours in flight are handed back uncounted. Not counted: a SIGKILL, an OOM
kill or a crash in the engine's step thread (which serves every request at once): nothing says which
record caused those.

``encode`` / ``decode`` are the metadata format: JSON, ``{"crashes": {"<offset>": [count, reason]}}``,
at most ``MAX_ENTRIES`` records with reasons cut to ``MAX_REASON`` characters (well inside 4096 bytes).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

Partition = tuple[str, int]
MAX_ENTRIES = 8  # records of one partition counted at once; the oldest offsets beyond are dropped
MAX_REASON = 300  # characters of each reason kept


@dataclass(frozen=True)
class Crash:
    count: int
    reason: str


def encode(crashes: dict[int, Crash]) -> str:
    """The metadata string for ``crashes`` ("" for none)."""
    if not crashes:
        return ""
    kept = sorted(crashes.items())[-MAX_ENTRIES:]
    return json.dumps({"crashes": {str(offset): [c.count, c.reason[:MAX_REASON]] for offset, c in kept}},
                      separators=(",", ":"))


def decode(metadata: str | None) -> dict[int, Crash]:
    """The crashes in a committed offset's metadata; what is not ours (another tool's commit, an
    older build's empty string) reads as none."""
    if not metadata:
        return {}
    try:
        entries = json.loads(metadata)["crashes"]
        return {int(offset): Crash(int(count), str(reason)) for offset, (count, reason) in entries.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring commit metadata that is not a crash count (%s): %.100r", exc, metadata)
        return {}


class CrashCounts:
    """The crash counts of the partitions this worker owns (the partition intake's thread only)."""

    def __init__(self) -> None:
        self._parts: dict[Partition, dict[int, Crash]] = {}
        self._unsaved: set[Partition] = set()  # counted here, not yet in a confirmed commit

    def known(self, partition: Partition) -> bool:
        return partition in self._parts

    def load(self, partition: Partition, metadata: str | None) -> None:
        """What the partition's committed offset carries (read when it is first taken from)."""
        self._parts[partition] = decode(metadata)
        if self._parts[partition]:
            log.info("%s[%d]: crash counts %s", *partition, {o: c.count for o, c in self._parts[partition].items()})

    def get(self, partition: Partition, offset: int) -> Crash | None:
        return self._parts.get(partition, {}).get(offset)

    def add(self, partition: Partition, offset: int, reason: str) -> Crash:
        """One more crash of the record at ``offset``; to be saved with the next commit."""
        crashes = self._parts.setdefault(partition, {})
        before = crashes.get(offset)
        crashes[offset] = crash = Crash((before.count if before else 0) + 1, reason)
        self._unsaved.add(partition)
        return crash

    def unsaved(self) -> set[Partition]:
        return set(self._unsaved)

    def metadata(self, partition: Partition, position: int) -> str:
        """The metadata to commit with ``position``: the counts of records not finished yet."""
        crashes = self._parts.get(partition)
        if not crashes:
            return ""
        for offset in [o for o in crashes if o < position]:  # finished (answered or dead-lettered)
            del crashes[offset]
        return encode(crashes)

    def saved(self, partition: Partition) -> None:
        """A synchronous commit carrying the partition's counts succeeded. (Asynchronous commits carry
        them too but do not count: a confirmation could be of a commit sent before the last ``add``.)"""
        self._unsaved.discard(partition)

    def forget(self, partitions: list[Partition]) -> None:
        """Partitions revoked: the next owner reads their counts from the broker (so do we, if they come back)."""
        for partition in partitions:
            self._parts.pop(partition, None)
            self._unsaved.discard(partition)
