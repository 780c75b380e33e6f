"""Dead letters: a record that cannot be decoded or served goes to ``chat.dlq`` with the reason.

One builder for every tier: :func:`dead_letter_for` keeps the original key, value and headers
byte for byte (so the record can be inspected, fixed and replayed), the error's type and message
as the reason, and the delivery count where the tier knows it (share groups). The letter is keyed
by its source topic (:func:`dead_letter_key`: the letters of one topic stay in order) and carries a
child of the original's traceparent (:func:`dead_letter_headers`).

The source may be any consumed message with ``topic``, ``partition``, ``offset``, ``key``,
``value`` and ``headers`` attributes: a :class:`transport.message.ConsumedMessage` or a Faust
event's message (whose headers may be a mapping). :func:`send_dead_letter` sends one through the
services' :class:`AckedWriter`; the streams worker sends the same record through Faust's producer.

Not here: deciding what is the record's fault (each tier's policy).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Protocol

from schemas.records import DeadLetter, Header
from schemas.topics import DLQ
from transport import tracing
from transport.acked_writer import AckedWriter

log = logging.getLogger(__name__)

DELIVERY_COUNT_HEADER = "chatpipe-delivery-count"
_LETTER_NAMESPACE = uuid.UUID("5b0f2d8e-3c1a-4e67-9d2b-7a8c4f1e6d30")


def dead_letter_id(component: str, topic: str, partition: int, offset: int) -> str:
    """The event id of a dead letter: the same whenever ``component`` refuses the same record, so a record
    re-read after a crash, or seen by every worker (``chat.cancels`` has no group), is one fact on
    ``chat.dlq``, not several (readers dedupe by ``event_id``, as everywhere)."""
    return uuid.uuid5(_LETTER_NAMESPACE, f"{component}|{topic}|{partition}|{offset}").hex


class SourceMessage(Protocol):
    """What a dead letter is built from (``ConsumedMessage``, a Faust event's ``message``)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Any  # list of (key, value) pairs, a mapping, or None


def source_headers(message: SourceMessage) -> list[tuple[str, bytes | None]]:
    """The message's headers as (key, value) pairs (Faust may hand a mapping, a client None)."""
    headers = message.headers or []
    if hasattr(headers, "items"):
        headers = headers.items()
    return [(k, v) for k, v in headers]


def dead_letter_for(message: SourceMessage, error: BaseException, component: str, *,
                    delivery_count: int | None = None) -> DeadLetter:
    """The dead letter of ``message``, refused by ``component`` because of ``error``."""
    headers = [Header(k, v) for k, v in source_headers(message)]
    if delivery_count is not None:
        headers.append(Header(DELIVERY_COUNT_HEADER, str(delivery_count).encode("ascii")))
    return DeadLetter(event_id=dead_letter_id(component, message.topic, message.partition, message.offset),
                      source_topic=message.topic, source_partition=message.partition, source_offset=message.offset,
                      key=message.key, value=message.value, headers=headers, error_type=type(error).__name__,
                      error_message=str(error), component=component)


def dead_letter_key(message: SourceMessage) -> bytes:
    """The key of a dead letter: its source topic, so the letters of one topic stay in order."""
    return message.topic.encode()


def dead_letter_headers(message: SourceMessage) -> list[tuple[str, bytes]]:
    """Kafka headers of a dead letter: a child of the original's traceparent (the trace follows it)."""
    parent = tracing.find(source_headers(message))
    return [(tracing.HEADER, tracing.child_traceparent(parent).encode("ascii"))]


def send_dead_letter(producer: AckedWriter, message: SourceMessage, error: BaseException, component: str, *,
                     delivery_count: int | None = None) -> asyncio.Future:
    """Build and send the dead letter of ``message``; the future resolves once it is durable."""
    letter = dead_letter_for(message, error, component, delivery_count=delivery_count)
    log.warning("dead-lettering %s[%s]@%s: %s: %s", message.topic, message.partition, message.offset,
                type(error).__name__, error)
    return producer.send(producer.settings.topic(DLQ), letter, key=dead_letter_key(message),
                         headers=dead_letter_headers(message))
