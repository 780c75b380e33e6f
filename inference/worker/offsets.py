"""Which offset each partition may commit when messages finish out of order. Pure Python.

A worker takes messages 5, 6, 7 of a partition and finishes 7 and 5 first: it may commit 6
(the next offset to read is the lowest one not finished), never 8, or a crash would lose 6.
When everything taken is finished, the commit position is one past the highest taken.

Not here: Kafka. The intake calls ``taken`` / ``finished`` / ``forget`` and commits what
``committable`` returns.
"""

from __future__ import annotations

import heapq
from typing import Collection

Partition = tuple[str, int]


class _PartitionOffsets:
    __slots__ = ("pending", "done", "next_offset", "committed")

    def __init__(self) -> None:
        self.pending: list[int] = []  # min-heap of taken offsets not yet known finished
        self.done: set[int] = set()  # finished offsets still in ``pending`` (lazy deletion)
        self.next_offset: int | None = None  # one past the highest offset taken
        self.committed: int | None = None  # last position handed out by ``committable``


class OffsetTracker:
    def __init__(self) -> None:
        self._parts: dict[Partition, _PartitionOffsets] = {}

    def taken(self, partition: Partition, offset: int) -> None:
        state = self._parts.setdefault(partition, _PartitionOffsets())
        heapq.heappush(state.pending, offset)
        if state.next_offset is None or offset + 1 > state.next_offset:
            state.next_offset = offset + 1

    def finished(self, partition: Partition, offset: int) -> bool:
        """Mark done; False when the partition is not tracked (revoked meanwhile): ignore it."""
        state = self._parts.get(partition)
        if state is None:
            return False
        state.done.add(offset)
        while state.pending and state.pending[0] in state.done:
            state.done.discard(heapq.heappop(state.pending))
        return True

    def position(self, partition: Partition) -> int | None:
        """The offset to commit for ``partition``: its lowest unfinished offset, else one past the last."""
        state = self._parts.get(partition)
        if state is None or state.next_offset is None:
            return None
        return state.pending[0] if state.pending else state.next_offset

    def unfinished(self, partition: Partition) -> int:
        state = self._parts.get(partition)
        return 0 if state is None else len(state.pending) - len(state.done)

    def committable(self, topics: Collection[str] | None = None) -> dict[Partition, int]:
        """Positions that moved since the last call (what to commit now), of ``topics`` or all."""
        out = {}
        for partition, state in self._parts.items():
            if topics is not None and partition[0] not in topics:
                continue
            pos = self.position(partition)
            if pos is not None and pos != state.committed:
                out[partition] = pos
                state.committed = pos
        return out

    def forget(self, partitions: list[Partition]) -> None:
        """Partitions revoked: what was unfinished there is someone else's now."""
        for partition in partitions:
            self._parts.pop(partition, None)

    def partitions(self) -> list[Partition]:
        return list(self._parts)
