"""Dead letters: a message that cannot be decoded or served goes to ``chat.dlq`` with the reason.

The original key, value and headers are kept byte for byte, so the record can be inspected,
fixed and replayed; nothing is silently dropped.
"""

from __future__ import annotations

import logging

from schemas.records import DeadLetter, Header
from schemas.topics import DLQ
from transport.message import ConsumedMessage
from transport.producer import RecordProducer

log = logging.getLogger(__name__)


class DeadLetterWriter:
    def __init__(self, producer: RecordProducer, *, component: str) -> None:
        self.producer = producer
        self.component = component
        self.topic = producer.settings.topic(DLQ)
        self.count = 0

    def send(self, message: ConsumedMessage, error: BaseException) -> DeadLetter:
        letter = DeadLetter(
            source_topic=message.topic,
            source_partition=message.partition,
            source_offset=message.offset,
            key=message.key,
            value=message.value,
            headers=[Header(k, v) for k, v in message.headers],
            error_type=type(error).__name__,
            error_message=str(error),
            component=self.component,
        )
        log.warning("dead-lettering %s[%s]@%s: %s", message.topic, message.partition, message.offset, error)
        # Keyed by source topic; the traceparent of the original follows it into the DLQ.
        self.producer.send(self.topic, letter, key=message.topic, parent_trace=message.traceparent)
        self.count += 1
        return letter
