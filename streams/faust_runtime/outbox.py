"""The records one batch produces through Faust, all on the broker before the batch is acked.

Awaiting Faust's ``topic.send`` only hands a record to aiokafka's buffer; its delivery is a
future of its own, which fails (after aiokafka's own retries) or may wait up to Faust's producer
request timeout (20 minutes) while the broker is away. An agent acks its batch only after
``deliver``: every future resolved, a failed record sent again, all within the retry budget
(``streams/faults.py``); past it ``InfrastructureUnavailableError`` leaves the batch unacked.
Sends are not awaited one by one: a batch's records travel together and are waited for once.

A record sent again may land twice (when the first copy did reach the broker): every topic
written here is read by key (request id, turn id, deletion event id), so a repeat is harmless.

Upstream: faust-streaming 0.15.3 ``Topic.send`` returns once aiokafka has buffered the record (its
``FutureMessage`` resolves on delivery). Tests: tests/streams/test_failure_policy.py
``test_a_record_whose_delivery_failed_is_sent_again_before_the_batch_counts_as_durable``,
``test_a_broker_away_past_the_budget_leaves_the_batch_undelivered``. The agents only see
``streams.ports.Outbox``; ``faust_runtime/agents.py`` makes one per batch and delivers it before the ack.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from aiokafka.errors import KafkaError

from streams.faults import Retrier
from transport import tracing
from transport.spans import Tracer

#: Longest one wait for the broker lasts before it counts as a failed attempt (and is logged):
#: aiokafka keeps retrying meanwhile, so a later attempt waits on the same futures again.
ATTEMPT_WAIT_S = 5.0


@dataclass(slots=True)
class _Send:
    topic: Any  # a Faust topic
    record: dict[str, Any]  # key, value, headers
    future: asyncio.Future | None = None  # None: not handed to the producer (yet, or again)

    async def start(self) -> None:
        self.future = await asyncio.wait_for(self.topic.send(**self.record), ATTEMPT_WAIT_S)


@dataclass
class Outbox:
    retrier: Retrier
    tracer: Tracer | None = None  # records a "send <topic>" span for each record sent with a parent_trace
    _pending: list[_Send] = field(default_factory=list)

    async def send(self, topic: Any, *, key: bytes | None, value: bytes, headers: list | None = None,
                   partition: int | None = None, parent_trace: str | None = None) -> None:
        """Hand one record to the producer; ``partition`` None: the key's partition (murmur2).

        With ``parent_trace`` (the traceparent of the span this record is produced in) and no
        ``headers``, the record gets a child traceparent, recorded as its producer span."""
        start_ns = time.time_ns()
        traceparent = None
        if parent_trace is not None and headers is None:
            traceparent = tracing.child_traceparent(parent_trace)
            headers = [(tracing.HEADER, traceparent.encode("ascii"))]
        record = {"key": key, "value": value, "headers": headers}
        if partition is not None:
            record["partition"] = partition
        item = _Send(topic, record)
        self._pending.append(item)
        name = topic.get_topic_name()
        await self.retrier.call(f"send to {name}", item.start)
        if traceparent is not None and self.tracer is not None:
            self.tracer.record_send(name, traceparent, parent_trace, start_ns, partition)

    async def deliver(self) -> None:
        """Return once the broker has acknowledged every record sent through this outbox."""
        if self._pending:
            await self.retrier.call(f"delivery of {len(self._pending)} record(s)", self._deliver_once)

    async def _deliver_once(self) -> None:
        for item in self._pending:
            if item.future is None:  # failed last time: send it again
                await item.start()
        _, waiting = await asyncio.wait([item.future for item in self._pending],
                                        timeout=ATTEMPT_WAIT_S)  # wait() cancels nothing
        errors: list[BaseException] = []
        still: list[_Send] = []
        for item in self._pending:
            if item.future in waiting:  # in flight: waited for again next time, not sent again
                still.append(item)
            elif item.future.cancelled() or item.future.exception() is not None:
                errors.append(KafkaError("delivery cancelled (the producer is stopping)") if item.future.cancelled()
                              else item.future.exception())
                item.future = None
                still.append(item)
        self._pending = still
        if waiting:
            raise TimeoutError(f"{len(waiting)} record(s) not acknowledged by the broker within {ATTEMPT_WAIT_S:g} s")
        if errors:
            raise errors[0]
