"""A consumer that reads every partition of its topics from the end, outside any group's sharing.

For broadcast topics every instance must see in full (``chat.cancels``: whichever worker runs
the generation has to stop it). ``assign()`` to all partitions at the end offset: no group
membership, no rebalances, nothing committed. What arrived before the instance started is not
its business.

Consumer errors are classified like ``GroupReader``'s (its module docstring has the table):
transient ones are polled through within an ``ErrorBudget``, any other raises ``TransportError``
so the thread reading it dies and takes its process down (docs/architecture.md "Failure policy")
instead of logging forever while nothing is read.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterable

from confluent_kafka import OFFSET_END, Consumer, TopicPartition

from transport.errors import TransportError
from transport.failures import ErrorBudget
from transport.group_reader import messages_of
from transport.message import ConsumedMessage
from transport.settings import KafkaSettings


class TailReader:
    def __init__(self, settings: KafkaSettings, *, topics: Iterable[str], timeout_s: float = 10.0,
                 extra_config: dict[str, Any] | None = None, error_budget_s: float = 60.0) -> None:
        self.topics = list(topics)
        self.errors = ErrorBudget(error_budget_s)
        self._consumer = Consumer({
            **settings.client_config(),
            # Required by librdkafka, never joined (assign, not subscribe) and never committed.
            "group.id": f"chatpipe-tail-{uuid.uuid4().hex[:12]}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            **(extra_config or {}),
        })
        metadata = self._consumer.list_topics(timeout=timeout_s)
        assignment = []
        for topic in self.topics:
            info = metadata.topics.get(topic)
            if info is None or info.error is not None:
                raise TransportError(f"topic {topic} is not on the broker; run `chatpipe topics apply`")
            assignment += [TopicPartition(topic, p, OFFSET_END) for p in info.partitions]
        self._consumer.assign(assignment)

    def poll_messages(self, max_messages: int, timeout_s: float) -> list[ConsumedMessage]:
        raw = self._consumer.consume(max_messages, 0)
        if not raw and timeout_s > 0:  # return at the first message, not after the whole timeout
            raw = self._consumer.consume(1, timeout_s)
        out = messages_of(raw, self.errors, lambda msg: f"tail consumer error on {msg.topic() or self.topics}")
        if out:
            self.errors.ok()
        return out

    def close(self) -> None:
        self._consumer.close()
