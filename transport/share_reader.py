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

Errors are classified by code as in ``transport.group_reader`` (its table): transient ones are
polled through within an ``ErrorBudget``, every other one raises ``TransportError``.

No lock renewal: KIP-1222's ``AcknowledgeType.RENEW`` is not in confluent-kafka 2.16
(``AcknowledgeType`` has ACCEPT, RELEASE, REJECT only; librdkafka 2.16 has no renew either), so a
record is held for the group's ``share.record.lock.duration.ms`` at most, and the caller must
finish within it (the worker sizes and bounds its generations to it, docs/worker.md).

One thread owns an instance. Not here: decoding, dead letters (the caller's policy).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable

from confluent_kafka import AcknowledgeType, KafkaError, KafkaException, ShareConsumer

from transport.errors import TransportError
from transport.failures import ErrorBudget
from transport.group_reader import messages_of
from transport.message import ConsumedMessage
from transport.settings import KafkaSettings
from transport.spans import Tracer

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


class ShareGroupReader:
    def __init__(
        self,
        settings: KafkaSettings,
        *,
        group_id: str,
        topics: Iterable[str],
        fetch_max_bytes: int = 16384,
        error_budget_s: float = 60.0,
        extra_config: dict[str, Any] | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.settings = settings
        self.group_id = group_id
        self.tracer = tracer or Tracer(settings.client_id)  # a "receive" span per batch (transport/spans.py)
        self.errors = ErrorBudget(error_budget_s)
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
        where = f"share consumer {self.group_id} on {self.topics}"
        try:
            batch = self._consumer.poll(timeout_s)
        except KafkaException as exc:
            err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            if err is None:
                raise TransportError(f"{where}: poll failed: {exc}") from exc
            self.errors.check(where, err)  # raises TransportError unless transient and within the budget
            return []
        if batch:
            self.tracer.record_receive(",".join(self.topics), self.group_id, batch, time.time_ns())
        out = messages_of(batch, self.errors, lambda msg: where, SharedMessage)
        if out:
            self.errors.ok()
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
