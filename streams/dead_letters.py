"""Dead letters of consumed records, and the trace headers of what an agent produces from them.

One ``DeadLetter`` builder serves every tier (``transport.dead_letters``).

The record is the same whichever tier refuses a message (``transport.dead_letters.dead_letter_for``:
original key, value and headers byte for byte, the error's type and message as the reason, an
``event_id`` derived from component, topic, partition and offset, so a record refused again after
a re-read is the same fact on ``chat.dlq``). The inference worker sends it through its
``AckedWriter``; streams sends it through Faust's producer, in the batch's ``Outbox``: the
refused record is acked with its batch, and only once its dead letter is on the broker.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Sequence

from schemas.codec import AvroCodec
from schemas.errors import DecodeError
from schemas.records import DeadLetter
from transport.dead_letters import dead_letter_for, dead_letter_headers, dead_letter_key, source_headers

log = logging.getLogger(__name__)


#: A consumed message's headers as (key, value) pairs (Faust may hand a mapping or a list).
event_headers = source_headers
#: Headers for a record produced because of a consumed message: a child of its traceparent.
child_headers = dead_letter_headers


def receive_batch(tracer: Any, group: str, messages: Sequence[Any]) -> int:
    """Record a batch's "receive" span (linked to each record's producer, transport/spans.py) and
    return when the batch's handling began (ns), the start of the agent's own spans."""
    start_ns = time.time_ns()
    if messages:
        tracer.record_receive(messages[0].topic, group, list(messages), start_ns)
    return start_ns


class DeadLetters:
    def __init__(self, topic: Any, codec: AvroCodec, component: str) -> None:
        self.topic = topic  # where the outbox sends them (a Faust topic with raw serializers in the worker)
        self.codec = codec
        self.component = component
        self.count = 0
        self.undecodable = 0  # of those, records that did not decode (the rest decoded and were refused)
        self.reasons: Counter[str] = Counter()  # error type -> letters (streams/metrics.py exposes them)

    async def send(self, m: Any, error: BaseException, outbox: Any) -> DeadLetter:
        """Dead-letter the consumed message ``m`` through ``outbox`` (``streams.ports.Outbox``)."""
        letter = dead_letter_for(m, error, self.component)
        log.warning("dead-lettering %s[%s]@%s: %s: %s", m.topic, m.partition, m.offset, type(error).__name__, error)
        await outbox.send(self.topic, key=dead_letter_key(m), value=self.codec.encode(letter),
                          headers=dead_letter_headers(m))
        self.count += 1
        self.undecodable += isinstance(error, DecodeError)
        self.reasons[type(error).__name__] += 1
        return letter
