"""Read a whole topic as it is now: every partition from its start to its current end, no consumer group.

For the logs read in full at a start or on demand: the deletion log (the erasure registry, ``chatpipe
forget --verify``), the model registry (``chat.models``), a state changelog. A compacted topic's end
offset may be no message (compaction left a gap): the consumer's position decides then.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

log = logging.getLogger(__name__)


def read_to_end(kafka: Any, topic: str, on_message: Callable[[Any], None], *, timeout_s: float = 30.0,
                progress: Callable[[int], None] | None = None, progress_every: int = 10_000,
                partitions: list[int] | None = None) -> int:
    """Hand every message of ``topic`` now on the broker (each partition from its start to its
    current end) to ``on_message``; returns how many. No consumer group: nothing is committed.

    ``progress(n)`` is called every ``progress_every`` messages (long scans, e.g. ``forget --verify``);
    ``partitions``: only these (default all).
    """
    from confluent_kafka import KafkaException, TopicPartition

    from transport import clients

    consumer = clients.consumer(kafka, "chatpipe-erasure-reader",
                                {"enable.auto.commit": False, "enable.partition.eof": False})
    try:
        try:
            meta = consumer.list_topics(topic, timeout=timeout_s)
        except KafkaException as exc:
            raise TimeoutError(f"{topic}: no metadata within {timeout_s} s ({exc})") from exc
        described = meta.topics.get(topic)
        if described is None or described.error is not None:
            log.warning("%s is not on the broker (%s): read as empty", topic,
                        described.error if described is not None else "unknown topic")
            return 0
        ends: dict[int, int] = {}
        starts: list[TopicPartition] = []
        for partition in described.partitions:
            if partitions is not None and partition not in partitions:
                continue
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout_s)
            if high > low:
                ends[partition] = high
                starts.append(TopicPartition(topic, partition, low))
        if not starts:
            return 0
        consumer.assign(starts)
        count = 0
        deadline = time.monotonic() + max(timeout_s, 1.0)
        while ends:
            batch = consumer.consume(500, 0.5)
            if not batch:  # the end offset may be no message (a compacted changelog's gap): ask the position
                for tp in consumer.position([TopicPartition(topic, p) for p in ends]):
                    if tp.offset >= ends[tp.partition]:
                        del ends[tp.partition]
                if not ends:
                    break
            if not batch and time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: partitions {sorted(ends)} not read to their end within {timeout_s} s "
                                   "without progress")
            for message in batch:
                if message.error() is not None:
                    continue
                deadline = time.monotonic() + max(timeout_s, 1.0)  # progress: the wait starts again
                partition = message.partition()
                if partition not in ends or message.offset() >= ends[partition]:
                    continue
                on_message(message)
                count += 1
                if progress is not None and count % progress_every == 0:
                    progress(count)
                if message.offset() >= ends[partition] - 1:
                    del ends[partition]
        return count
    finally:
        consumer.close()
