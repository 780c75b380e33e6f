"""A consumer-group consumer for services that finish messages out of order.

``BatchConsumer.commit()`` commits everything polled, which suits a batch that is done as a
whole. A service with many messages in flight (the inference worker) instead needs:

- rebalance hooks (``on_assign`` / ``on_revoke`` / ``on_lost``) to stop the work of partitions
  it no longer owns, with the cooperative-sticky protocol so a joining member does not revoke
  everything from everybody;
- ``pause`` / ``resume`` per partition (backpressure: the fetcher stops, memory stays bounded);
- ``commit_offsets`` of explicit positions (its own per-partition "lowest unfinished offset").

One thread owns an instance: librdkafka calls the rebalance hooks from inside ``poll_messages``.
Decoding is the caller's business (raw ``ConsumedMessage``s come out).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from transport.errors import TransportError
from transport.message import ConsumedMessage
from transport.settings import KafkaSettings

log = logging.getLogger(__name__)

PartitionsHook = Callable[[list[tuple[str, int]]], None]


class GroupConsumer:
    def __init__(
        self,
        settings: KafkaSettings,
        *,
        group_id: str,
        topics: Iterable[str],
        on_assign: PartitionsHook | None = None,
        on_revoke: PartitionsHook | None = None,
        on_lost: PartitionsHook | None = None,
        extra_config: dict[str, Any] | None = None,
    ) -> None:
        self.settings = settings
        self._hooks = (on_assign, on_revoke, on_lost or on_revoke)
        self.assignment: set[tuple[str, int]] = set()
        self._consumer = Consumer({
            **settings.client_config(),
            "group.id": group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "cooperative-sticky",
            **(extra_config or {}),
        })
        self.topics = list(topics)
        self._consumer.subscribe(self.topics, on_assign=self._assigned, on_revoke=self._revoked,
                                 on_lost=self._lost)

    # librdkafka calls these from inside poll(); with cooperative-sticky they carry only the change.
    def _assigned(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        pairs = [(tp.topic, tp.partition) for tp in partitions]
        self.assignment.update(pairs)
        if self._hooks[0]:
            self._hooks[0](pairs)

    def _revoked(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        pairs = [(tp.topic, tp.partition) for tp in partitions]
        if self._hooks[1]:
            self._hooks[1](pairs)
        self.assignment.difference_update(pairs)

    def _lost(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        pairs = [(tp.topic, tp.partition) for tp in partitions]
        if self._hooks[2]:
            self._hooks[2](pairs)
        self.assignment.difference_update(pairs)

    def poll_messages(self, max_messages: int, timeout_s: float) -> list[ConsumedMessage]:
        """Up to ``max_messages``; returns as soon as one is there (waits at most ``timeout_s``).

        ``consume(n, timeout)`` alone waits for n messages or the whole timeout: a lone
        request would sit ``timeout_s`` in the client before anyone sees it.
        """
        raw = self._consumer.consume(max(1, max_messages), 0)
        if not raw and timeout_s > 0:
            raw = self._consumer.consume(1, timeout_s)
            if raw and max_messages > 1:
                raw += self._consumer.consume(max_messages - 1, 0)
        out = []
        for msg in raw:
            err = msg.error()
            if err is None:
                out.append(ConsumedMessage(msg))
            elif err.code() == KafkaError._PARTITION_EOF:
                continue
            elif err.fatal() or not err.retriable():
                raise TransportError(f"consumer error on {msg.topic()}: {err.str()}")
            else:
                log.warning("retriable consumer error: %s", err.str())
        return out

    def pause(self, partitions: Iterable[tuple[str, int]]) -> None:
        tps = [TopicPartition(t, p) for t, p in partitions]
        if tps:
            self._consumer.pause(tps)

    def resume(self, partitions: Iterable[tuple[str, int]]) -> None:
        tps = [TopicPartition(t, p) for t, p in partitions]
        if tps:
            self._consumer.resume(tps)

    def seek(self, topic: str, partition: int, offset: int) -> None:
        """Read ``topic[partition]`` from ``offset`` next: what was prefetched of it is dropped and
        fetched again (a paused partition too: librdkafka keeps handing out prefetched records of a
        partition after ``pause``)."""
        self._consumer.seek(TopicPartition(topic, partition, offset))

    def commit_offsets(self, offsets: dict[tuple[str, int], int], *, asynchronous: bool = True) -> None:
        """Commit ``{(topic, partition): next offset to read}``."""
        if not offsets:
            return
        tps = [TopicPartition(t, p, off) for (t, p), off in offsets.items()]
        try:
            self._consumer.commit(offsets=tps, asynchronous=asynchronous)
        except KafkaException as exc:
            raise TransportError(f"commit of {offsets} failed: {exc}") from exc

    def committed(self, partitions: Iterable[tuple[str, int]], timeout_s: float = 10.0) -> dict[tuple[str, int], int]:
        tps = self._consumer.committed([TopicPartition(t, p) for t, p in partitions], timeout=timeout_s)
        return {(tp.topic, tp.partition): tp.offset for tp in tps}

    def lag(self) -> int:
        """Messages behind the end of the assigned partitions (cached watermarks; -1 unknown)."""
        total = 0
        assigned = [TopicPartition(t, p) for t, p in self.assignment]
        if not assigned:
            return 0
        try:
            positions = self._consumer.position(assigned)
        except KafkaException:
            return -1
        for tp in positions:
            low, high = self._consumer.get_watermark_offsets(tp, cached=True)
            if high < 0:
                continue
            pos = tp.offset if tp.offset >= 0 else low
            total += max(0, high - pos)
        return total

    def close(self) -> None:
        """Leave the group (partitions move at once instead of after the session timeout)."""
        self._consumer.close()
