"""A consumer that reads every partition of its topics from the end, outside any group's sharing.

For broadcast topics every instance must see in full (``chat.cancels``: whichever worker runs
the generation has to stop it) and for a topic one instance owns (the gateway's reply topic).
``assign()`` to all partitions at the end offset, read when the reader is made (so a record
produced after the constructor returns is never skipped): no group membership, no rebalances,
nothing committed. What arrived before the instance started is not its business.

Consumer errors are classified like ``GroupReader``'s (its module docstring has the table):
transient ones are polled through within an ``ErrorBudget``, any other raises ``TransportError``
so the thread reading it dies and takes its process down (docs/architecture.md "Failure policy")
instead of logging forever while nothing is read.

A topic deleted under an ``assign()``ed reader is not such an error: librdkafka reports it once at
most and then fetches nothing, silently (tests/gateway/test_deadlines_and_outages.py: the gateway's
reply topic deleted). So every ``topic_check_s`` the reader looks at the broker's metadata, and a
topic of its own that is missing counts as a transient ``UNKNOWN_TOPIC_OR_PART`` (it may be being
recreated) until the budget is spent.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from transport.errors import TransportError
from transport.failures import ErrorBudget, kafka_error
from transport.group_reader import messages_of
from transport.message import ConsumedMessage
from transport.settings import KafkaSettings


class TailReader:
    def __init__(self, settings: KafkaSettings, *, topics: Iterable[str], timeout_s: float = 10.0,
                 extra_config: dict[str, Any] | None = None, error_budget_s: float = 60.0,
                 topic_check_s: float = 10.0) -> None:
        self.topics = list(topics)
        self.errors = ErrorBudget(error_budget_s)
        # Its own budget: records of another topic of this reader (a status topic beside a reply topic)
        # must not reset the streak of a topic that is gone.
        self.missing_topics = ErrorBudget(error_budget_s)
        self.topic_check_s = topic_check_s
        self._next_check = time.monotonic() + topic_check_s
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
            for partition in info.partitions:
                _, end = self._consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout_s)
                assignment.append(TopicPartition(topic, partition, end))
        self._consumer.assign(assignment)

    def poll_messages(self, max_messages: int, timeout_s: float) -> list[ConsumedMessage]:
        self._check_topics()
        raw = self._consumer.consume(max_messages, 0)
        if not raw and timeout_s > 0:  # return at the first message, not after the whole timeout
            raw = self._consumer.consume(1, timeout_s)
        out = messages_of(raw, self.errors, lambda msg: f"tail consumer error on {msg.topic() or self.topics}")
        if out:
            self.errors.ok()
        return out

    def _check_topics(self) -> None:
        """Every ``topic_check_s``: a topic of this reader missing from the broker's metadata is a
        transient error for the budget (the module docstring says why librdkafka does not tell)."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self.topic_check_s
        where = f"tail consumer of {', '.join(self.topics)}"
        try:
            metadata = self._consumer.list_topics(timeout=5)
        except KafkaException as exc:  # the broker away: the same budget as its consumer errors
            self.errors.check(where, kafka_error(exc) or KafkaError(KafkaError._TRANSPORT, str(exc)))
            return
        # The broker answered: a streak of errors is over. Without this a quiet topic (no record to
        # reset it) kept a broker restart's streak, and one slow metadata answer a minute later
        # (a loaded machine) spent the whole budget: a gateway exited with the broker back.
        self.errors.ok()
        missing = [t for t in self.topics if metadata.topics.get(t) is None or metadata.topics[t].error is not None]
        if not missing:
            self.missing_topics.ok()
        for topic in missing:
            self.missing_topics.transient(where, KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART,
                                                            f"topic {topic} is not on the broker any more"))

    def close(self) -> None:
        self._consumer.close()
