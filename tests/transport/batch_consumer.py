"""A batch consumer for the transport tests: poll many messages at once, decode them, dead-letter
what does not decode, commit everything polled when told.

The services consume with ``transport.group_reader.GroupReader`` (out-of-order finishing,
explicit offsets), ``transport.share_reader.ShareGroupReader`` or Faust; a test that reads
what a service wrote wants "give me the next records" instead.

The error policy is an injected callback ``on_decode_error(exc, message)``: by default the
message goes to the dead-letter topic (:class:`DeadLetterWriter`, the same ``DeadLetter`` record
the services write: ``transport.dead_letters.dead_letter_for``) and the consumer moves on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from confluent_kafka import KafkaError

from chatpipe.testing.kafka.writer import RecordWriter
from schemas.codec import default_codec
from schemas.errors import DecodeError
from schemas.records import DeadLetter
from schemas.topics import DLQ
from transport import clients
from transport.batches import pause_gc, resume_gc, wrap_batch
from transport.dead_letters import dead_letter_for, dead_letter_headers, dead_letter_key
from transport.errors import TransportError
from transport.message import ConsumedMessage
from transport.settings import KafkaSettings

log = logging.getLogger(__name__)

DecodeErrorPolicy = Callable[[DecodeError, ConsumedMessage], None]


@dataclass(frozen=True, slots=True)
class DecodedMessage:
    """A record with the message it came in (batches built as ``transport/batches.py`` builds the
    services' own)."""
    record: Any
    message: ConsumedMessage


class DeadLetterWriter:
    """Dead letters through a :class:`RecordWriter` (flushed by ``BatchConsumer.commit``)."""

    def __init__(self, producer: RecordWriter, *, component: str) -> None:
        self.producer = producer
        self.component = component
        self.topic = producer.settings.topic(DLQ)
        self.count = 0

    def send(self, message: ConsumedMessage, error: BaseException) -> DeadLetter:
        letter = dead_letter_for(message, error, self.component)
        log.warning("dead-lettering %s[%s]@%s: %s", message.topic, message.partition, message.offset, error)
        self.producer.send(self.topic, letter, key=dead_letter_key(message), headers=dead_letter_headers(message))
        self.count += 1
        return letter


class BatchConsumer:
    def __init__(self, settings: KafkaSettings, *, group_id: str, topics: Iterable[str],
                 dead_letters: DeadLetterWriter | None = None, on_decode_error: DecodeErrorPolicy | None = None) -> None:
        self.settings = settings
        self.codec = default_codec()
        self._dead_letters = dead_letters
        if on_decode_error is None:
            if dead_letters is None:
                raise ValueError("give dead_letters or on_decode_error: undecodable messages need a place to go")
            on_decode_error = lambda exc, msg: dead_letters.send(msg, exc)
        self.on_decode_error = on_decode_error
        self._consumer = clients.consumer(settings, group_id, {"enable.auto.commit": False,
                                                               "auto.offset.reset": "earliest"})
        self._consumer.subscribe(list(topics))

    def poll_messages(self, max_messages: int = 500, timeout_s: float = 1.0) -> list[ConsumedMessage]:
        """Up to ``max_messages`` raw messages, waiting at most ``timeout_s`` for the first."""
        raw = self._consumer.consume(max_messages, timeout_s)
        clean = wrap_batch(raw)  # fast path: no error events in the batch
        if clean is not None:
            return clean
        out = []
        for msg in raw:
            err = msg.error()
            if err is None:
                out.append(ConsumedMessage(msg))
                continue
            if err.code() == KafkaError._PARTITION_EOF:
                continue
            if err.fatal() or not err.retriable():
                raise TransportError(f"consumer error on {msg.topic()}: {err.str()}")
            log.warning("retriable consumer error: %s", err.str())
        return out

    def poll_records(self, expected: type | None = None, max_messages: int = 500,
                     timeout_s: float = 1.0) -> list[DecodedMessage]:
        """Decoded records of the next batch; messages that don't decode go to the error policy."""
        messages = self.poll_messages(max_messages, timeout_s)
        # The records of a batch are built without collections in between; paused before any
        # allocation, as the wrapping just done may have left the collector due (see pause_gc).
        pause_gc()
        try:
            decoded, decode = [], self.codec.decode
            for message in messages:
                try:
                    value = message.value
                    if value is None:
                        raise DecodeError("empty value (tombstone) where a record was expected")
                    record = decode(value, expected)
                except DecodeError as exc:  # the message's position is looked up only for a bad one
                    located = exc.at(message.topic, message.partition, message.offset)
                    located.__cause__ = exc
                    self.on_decode_error(located, message)
                    continue
                decoded.append(DecodedMessage(record, message))
        finally:
            resume_gc()
        return decoded

    def commit(self) -> None:
        """Commit the positions after everything polled so far (synchronously).

        Dead letters of the batch are flushed first: a message is only passed over once its
        dead-letter copy is durable.
        """
        if self._dead_letters is not None:
            self._dead_letters.producer.flush()
        try:
            self._consumer.commit(asynchronous=False)
        except Exception as exc:  # KafkaException: e.g. no offset stored yet
            if "NO_OFFSET" in str(exc):
                return
            raise TransportError(f"commit failed: {exc}") from exc

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> "BatchConsumer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
