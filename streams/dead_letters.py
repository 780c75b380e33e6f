"""Dead letters from Faust events: the same ``DeadLetter`` record ``transport.dead_letters`` writes.

``transport.DeadLetterWriter`` sends through a confluent-kafka producer; the Faust worker sends
through its own (aiokafka) producer, so this is the same record built from a Faust event: the
original key, value and headers byte for byte, the error's type and message as the reason.
"""

from __future__ import annotations

import logging
from typing import Any

from schemas.codec import AvroCodec
from schemas.records import DeadLetter, Header
from transport import tracing

log = logging.getLogger(__name__)


def event_headers(message: Any) -> list[tuple[str, bytes | None]]:
    """A Faust message's headers as (key, value) pairs (Faust may hand a mapping or a list)."""
    headers = message.headers or []
    if hasattr(headers, "items"):
        headers = list(headers.items())
    return [(k, v) for k, v in headers]


def child_headers(message: Any) -> list[tuple[str, bytes]]:
    """Headers for a record produced because of ``message``: a child of its traceparent."""
    parent = tracing.find(event_headers(message))
    return [(tracing.HEADER, tracing.child_traceparent(parent).encode("ascii"))]


class DeadLetters:
    def __init__(self, topic: Any, codec: AvroCodec, component: str) -> None:
        self.topic = topic  # a Faust topic with raw key/value serializers
        self.codec = codec
        self.component = component
        self.count = 0

    async def send(self, event: Any, error: BaseException) -> DeadLetter:
        m = event.message
        letter = DeadLetter(
            source_topic=m.topic, source_partition=m.partition, source_offset=m.offset,
            key=m.key, value=m.value, headers=[Header(k, v) for k, v in event_headers(m)],
            error_type=type(error).__name__, error_message=str(error), component=self.component,
        )
        log.warning("dead-lettering %s[%s]@%s: %s: %s", m.topic, m.partition, m.offset, type(error).__name__, error)
        # Keyed by source topic, like transport's DeadLetterWriter.
        await self.topic.send(key=m.topic.encode(), value=self.codec.encode(letter), headers=child_headers(m))
        self.count += 1
        return letter
