"""The records one batch produces through Faust, all on the broker before the batch is acked.

Awaiting Faust's ``topic.send`` only hands a record to aiokafka's buffer; its delivery is a
future of its own, which fails (after aiokafka's own retries) or may wait up to Faust's producer
request timeout (20 minutes) while the broker is away. An agent acks its batch only after
``deliver``: every future resolved, a failed record sent again, all within the retry budget
(``streams/faults.py``); past it ``InfrastructureUnavailableError`` leaves the batch unacked.
Sends are not awaited one by one: a batch's records travel together and are waited for once.

A record sent again may land twice (when the first copy did reach the broker): every topic
written here is read by key (request id, turn id, deletion event id), so a repeat is harmless.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from aiokafka.errors import KafkaError

from streams.faults import Retrier

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
    _pending: list[_Send] = field(default_factory=list)

    async def send(self, topic: Any, *, key: bytes | None, value: bytes, headers: list | None = None,
                   partition: int | None = None) -> None:
        """Hand one record to the producer; ``partition`` None: the key's partition (murmur2)."""
        record = {"key": key, "value": value, "headers": headers}
        if partition is not None:
            record["partition"] = partition
        item = _Send(topic, record)
        self._pending.append(item)
        await self.retrier.call(f"send to {topic.get_topic_name()}", item.start)

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
