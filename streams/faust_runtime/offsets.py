"""Where Faust's consumer reads from: its seek back to the committed offsets, made to cover the
partitions nobody has committed yet, and the group's committed offset asked of the broker.

After a rebalance Faust's recovery resumes fetching, then seeks every stream partition back to its
committed offset (``Consumer.perform_seek``), so that events fetched meanwhile, and dropped with the
queues Faust clears, come again. aiokafka's ``seek_to_committed`` only seeks a partition whose
committed offset is above 0 (``if offset and offset > 0``): a partition with none keeps the fetcher's
position, and what was fetched and dropped before the seek never comes again.

Seen on the scale-out stack (CI, 2026-12-04, tests/cluster/test_streams_scale_out.py): a new group
rebalanced while the first responses arrived; offsets 0 and 1 of ``chat.responses[5]`` were fetched
and never handed to the record agent, 2.. were, and their commit went over 0 and 1: two answers never
became turns, and nothing waited on the partition for the progress watchdog to see.

With no committed offset the group's reset policy says where reading starts
(``consumer_auto_offset_reset="earliest"``, streams/app.py), so such a partition of an agent's source
topic is sought to its beginning. Events this process handled already come again and are acked as
repeats without being handled twice (``acks.py``). Changelog partitions are left alone: Faust's
recovery seeks those itself.

Upstream: aiokafka ``AIOKafkaConsumer.seek_to_committed`` (``if offset and offset > 0``), called by
faust-streaming 0.15.3's ``Consumer.perform_seek`` through ``AIOKafkaConsumerThread.seek_to_committed``,
which ``install`` replaces (a monkeypatch, once per process, from ``streams/app.py``). Tests:
tests/streams/test_faust_offsets.py ``test_a_partition_nobody_committed_is_read_again_from_its_start`` (the
upstream skip, then the fix, on the real broker), ``test_the_seek_is_patched_into_fausts_consumer_thread_once``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Mapping

log = logging.getLogger(__name__)

#: Longest the broker is waited for when asked for a group's committed offset.
COMMITTED_WAIT_S = 5.0


async def seek_to_committed_or_beginning(consumer: Any, resets: Callable[[str], bool] = lambda topic: True
                                         ) -> Mapping[Any, int | None]:
    """Seek ``consumer`` (an aiokafka consumer, on its own loop) to the committed offset of each assigned
    partition, and each one with none whose topic ``resets`` accepts to its beginning; returns the
    committed offsets, as aiokafka's ``seek_to_committed`` does."""
    committed = await consumer.seek_to_committed()
    never = [tp for tp, offset in committed.items() if (offset is None or offset <= 0) and resets(tp.topic)]
    if never:
        # debug: every empty partition (no deletions yet, say) is listed at each rebalance
        log.debug("no committed offset for %s: read from the beginning (the group reads from the earliest)",
                  ", ".join(f"{tp.topic}[{tp.partition}]" for tp in sorted(never)))
        await consumer.seek_to_beginning(*never)
    return committed


def install() -> None:
    """Make Faust's aiokafka consumer thread seek with ``seek_to_committed_or_beginning`` (once per process)."""
    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

    if getattr(AIOKafkaConsumerThread.seek_to_committed, "covers_uncommitted", False):
        return

    async def seek_to_committed(self: Any) -> Mapping[Any, int | None]:
        app = self.app
        changelogs = set(app.tables.changelog_topics)

        def resets(topic: str) -> bool:  # an agent's source topic (acked stream), not a table's changelog
            return app.topics.acks_enabled_for(topic) and topic not in changelogs

        return await self.call_thread(seek_to_committed_or_beginning, self._ensure_consumer(), resets)

    seek_to_committed.covers_uncommitted = True
    AIOKafkaConsumerThread.seek_to_committed = seek_to_committed


def committed_position(consumer: Any, tp: Any) -> int | None:
    """The committed position of ``tp`` in Faust's ``consumer`` (next offset to read; None when not known)."""
    committed = getattr(consumer, "_committed_offset", None)  # Faust keeps it per TP, next-to-read
    try:
        value = committed.get(tp) if committed is not None else None
    except Exception:  # noqa: BLE001 - no consumer (a test double) or not started
        return None
    return value if isinstance(value, int) and value >= 0 else None


async def group_committed(faust_consumer: Any, tp: Any) -> int | None:
    """The group's committed offset of ``tp`` on the broker (None: nothing committed).

    Faust's own ``_committed_offset`` is filled only by its seek back and its commits: a new process
    is handed events before it knows where the group stands. Asked through Faust's aiokafka consumer
    on its own thread; raises when the broker does not answer within ``COMMITTED_WAIT_S``."""
    from aiokafka.structs import TopicPartition

    thread = faust_consumer._thread  # faust's AIOKafkaConsumerThread: the aiokafka consumer lives on its loop
    consumer = thread._ensure_consumer()
    return await asyncio.wait_for(thread.call_thread(consumer.committed, TopicPartition(tp[0], tp[1])),
                                  COMMITTED_WAIT_S)
