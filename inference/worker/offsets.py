"""Which offset each partition may commit when messages finish out of order. Pure Python.

A worker takes messages 5, 6, 7 of a partition and finishes 7 and 5 first: it may commit 6
(the next offset to read is the lowest one not finished), never 8, or a crash would lose 6.
When everything taken is finished, the commit position is one past the highest taken.

A position counts as committed only once the broker confirmed it (``commit_succeeded``): one
handed out by ``committable`` is "in flight", not offered again while it is, and offered again
after ``commit_failed`` (a failed async commit used to be forgotten, and the position was never
committed unless a later finish moved it).

Not here: Kafka. The intake calls ``taken`` / ``finished`` / ``forget``, commits what
``committable`` returns and reports how each commit went.
"""

from __future__ import annotations

import heapq
from typing import Collection

Partition = tuple[str, int]


class _PartitionOffsets:
    __slots__ = ("pending", "done", "next_offset", "committed", "in_flight")

    def __init__(self) -> None:
        self.pending: list[int] = []  # min-heap of taken offsets not yet known finished
        self.done: set[int] = set()  # finished offsets still in ``pending`` (lazy deletion)
        self.next_offset: int | None = None  # one past the highest offset taken
        self.committed: int | None = None  # highest position the broker confirmed committed
        self.in_flight: int | None = None  # handed out by ``committable``, not confirmed or failed yet


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

    def committable(self, topics: Collection[str] | None = None) -> dict[Partition, int]:
        """Positions to commit now, of ``topics`` or all: those not confirmed committed and not
        already in flight. Each one returned is in flight until ``commit_succeeded`` or
        ``commit_failed`` is called for it."""
        out = {}
        for partition, state in self._parts.items():
            if topics is not None and partition[0] not in topics:
                continue
            pos = self.position(partition)
            if pos is not None and pos != state.committed and pos != state.in_flight:
                out[partition] = state.in_flight = pos
        return out

    def commit_succeeded(self, partition: Partition, offset: int) -> None:
        state = self._parts.get(partition)
        if state is None:  # forgotten (revoked) meanwhile
            return
        # Commits of one partition are confirmed in order; max() keeps a late, older confirmation
        # from moving the mark back (which would only cost one needless commit anyway).
        state.committed = offset if state.committed is None else max(state.committed, offset)
        if state.in_flight is not None and state.in_flight <= offset:
            state.in_flight = None

    def commit_failed(self, partition: Partition, offset: int) -> None:
        """The commit of ``offset`` did not happen: offer the position again on the next call."""
        state = self._parts.get(partition)
        if state is not None and state.in_flight == offset:
            state.in_flight = None

    def forget(self, partitions: list[Partition]) -> None:
        """Partitions revoked: what was unfinished there is someone else's now."""
        for partition in partitions:
            self._parts.pop(partition, None)
