"""A Kafka share-group consumer (KIP-932) with explicit, per-record acknowledgement.

Any member of a share group may receive any record of any partition: the queue-like "whoever
is free takes the next one" pull. Each record is *acquired* for a lock duration and must be
acknowledged: ACCEPT (done), RELEASE (give it back for another delivery) or REJECT (never
deliver again). ``delivery_count`` tells how often a record was acquired.

confluent-kafka 2.16's ``ShareConsumer`` is marked preview. What was seen on our broker (4.4):

- ``max.poll.records`` is not a limit (5 asked, 10 or 30 returned); ``fetch.max.bytes`` is the
  knob that bounds one poll, so callers still RELEASE what they cannot take;
- a share group starts at the *latest* offset unless its ``share.auto.offset.reset`` group
  config says ``earliest`` (``TopicAdmin.set_share_group_config``);
- acquisitions of released records count as deliveries;
- records held by a member that dies are redelivered to another member within seconds.

One thread owns an instance. Not here: decoding, dead letters (the caller's policy).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from confluent_kafka import AcknowledgeType, KafkaException, ShareConsumer

from transport.errors import TransportError
from transport.message import ConsumedMessage
from transport.settings import KafkaSettings

log = logging.getLogger(__name__)

ACCEPT = AcknowledgeType.ACCEPT
RELEASE = AcknowledgeType.RELEASE
REJECT = AcknowledgeType.REJECT


class SharedMessage(ConsumedMessage):
    """A consumed record of a share group: a ``ConsumedMessage`` plus its delivery count."""

    __slots__ = ()

    @property
    def delivery_count(self) -> int:
        return self._msg.delivery_count() or 1

    @property
    def raw(self) -> Any:
        return self._msg


class ShareGroupConsumer:
    def __init__(
        self,
        settings: KafkaSettings,
        *,
        group_id: str,
        topics: Iterable[str],
        fetch_max_bytes: int = 16384,
        extra_config: dict[str, Any] | None = None,
    ) -> None:
        self.settings = settings
        self.group_id = group_id
        self._consumer = ShareConsumer({
            **settings.client_config(),
            "group.id": group_id,
            "share.acknowledgement.mode": "explicit",
            "fetch.max.bytes": fetch_max_bytes,
            **(extra_config or {}),
        })
        self.topics = list(topics)
        self._consumer.subscribe(self.topics)

    def poll_messages(self, timeout_s: float) -> list[SharedMessage]:
        try:
            batch = self._consumer.poll(timeout_s)
        except KafkaException as exc:
            raise TransportError(f"share consumer poll on {self.topics}: {exc}") from exc
        out = []
        for msg in batch:
            err = msg.error()
            if err is None:
                out.append(SharedMessage(msg))
            elif err.fatal() or not err.retriable():
                raise TransportError(f"share consumer error on {msg.topic()}: {err.str()}")
            else:
                log.warning("retriable share consumer error: %s", err.str())
        return out

    def acknowledge(self, message: SharedMessage, ack: AcknowledgeType) -> None:
        self._consumer.acknowledge(message.raw, ack)

    def commit(self, *, asynchronous: bool = True, timeout_s: float = 10.0) -> None:
        """Send the acknowledgements made so far (they also ride on the next poll)."""
        try:
            if asynchronous:
                self._consumer.commit_async()
            else:
                self._consumer.commit_sync(timeout_s)
        except KafkaException as exc:
            raise TransportError(f"share acknowledgement commit failed: {exc}") from exc

    def close(self) -> None:
        self._consumer.close()
