"""Read-your-writes between the record agent and intake: how far each ``chat.responses`` partition is recorded.

A client that sends its follow-up as soon as it has the previous answer's final chunk (an agent,
a test, a fast typist) expects the follow-up's context to hold that answer. The inference worker
puts the ``Response`` on ``chat.responses`` before it sends the final chunk (inference/worker/
worker.py), so once the client has the final chunk, the Response lies below the end offset of
its conversation's ``chat.responses`` partition. Before intake assembles a prompt of a
conversation with a pending request (sent to inference, not yet recorded), it asks for that end
offset and waits until the record agent has applied every response below it to the table; then
the table holds the turn. A conversation with nothing pending has nothing unrecorded, so a first
prompt, and every prompt of an idle conversation, waits for nothing.

What this process recorded of a partition is tracked here (``applied``, from the record agent,
after a batch's table writes); below Faust's committed position everything was recorded before,
by this process or the partition's previous owner (the table's changelog holds it).

The wait is bounded (``StreamsSettings.recorded_wait_s``): a record agent held up by a Qdrant
outage delays follow-ups that long at most; past it intake assembles without the missing turns
and says so in the log (the fault itself ends the process within the retry budget).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Iterable, Mapping

from transport.settings import KafkaSettings

#: the committed position (next offset to read) of a ``chat.responses`` partition, None if unknown
CommittedPosition = Callable[[int], "int | None"]
#: the end offsets (next offset to be written) of ``chat.responses`` partitions, fetched from the broker
EndOffsets = Callable[[list[int]], Awaitable[Mapping[int, int]]]


class BrokerEndOffsets:
    """``EndOffsets`` asked of the broker by a librdkafka consumer of its own (no group), in a thread
    of its own. Not Faust's consumer: its ``highwaters`` goes through the consumer thread's method
    queue and took ~290 ms here (it waited behind the long fetch), a librdkafka query ~1 ms."""

    def __init__(self, kafka: KafkaSettings, topic: str, timeout_s: float = 5.0) -> None:
        self.kafka, self.topic, self.timeout_s = kafka, topic, timeout_s
        self._consumer: Any = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatpipe-streams-ends")
        # Connect now, in the background: the first query otherwise pays the connection (~30 ms here).
        self._thread.submit(self._ends, [0])

    def _ends(self, partitions: list[int]) -> dict[int, int]:
        from confluent_kafka import TopicPartition

        from transport import clients

        if self._consumer is None:  # made in its thread (the warm-up call): librdkafka clients stay in one
            self._consumer = clients.consumer(self.kafka, f"{self.topic}.ends", {"enable.auto.commit": False})
        return {p: self._consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=self.timeout_s,
                                                        cached=False)[1]
                for p in partitions}

    async def __call__(self, partitions: list[int]) -> dict[int, int]:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._ends, partitions)

    def close(self) -> None:
        def close_consumer() -> None:
            if self._consumer is not None:
                self._consumer.close()

        self._thread.submit(close_consumer).result(timeout=10)
        self._thread.shutdown(wait=True)


class RecordedOffsets:
    """Per ``chat.responses`` partition, the offset below which every response is in the table."""

    def __init__(self, committed: CommittedPosition, end_offsets: EndOffsets,
                 owned: Callable[[int], bool] = lambda partition: True) -> None:
        self._committed = committed
        self._end_offsets = end_offsets
        # Whether this process's record agent reads the partition: a prompt placed on another partition
        # than its conversation's (a producer breaking the partitioner rule, docs/producing.md) or
        # one taken mid-rebalance would otherwise wait out the timeout for what another worker records.
        self._owned = owned
        self._applied: dict[int, int] = {}  # partition -> one past the highest offset this process recorded
        self._changed = asyncio.Event()  # replaced after each set: every waiter of a change wakes once

    def applied(self, partition: int, offset: int) -> None:
        """The record agent has written the effects of ``offset`` (and every offset before) to the table."""
        self._applied[partition] = max(offset + 1, self._applied.get(partition, 0))
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def through(self, partition: int) -> int:
        """Every response below this offset of ``partition`` is recorded."""
        return max(self._applied.get(partition, 0), self._committed(partition) or 0)  # committed None: not known

    async def wait_for_end(self, partitions: Iterable[int], timeout_s: float) -> dict[int, int]:
        """Wait until the responses up to the current end of each partition are recorded, at most
        ``timeout_s``; returns the partitions still short then (partition -> responses missing)."""
        wanted = sorted(p for p in set(partitions) if self._owned(p))
        if not wanted:
            return {}
        ends = await self._end_offsets(wanted)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            short = {p: end - self.through(p) for p, end in ends.items() if self.through(p) < end}
            remaining = deadline - loop.time()
            if not short or remaining <= 0:
                return short
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass
