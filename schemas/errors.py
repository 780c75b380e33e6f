"""The named errors of the contracts layer: one root, one class per way a record can be bad."""

from __future__ import annotations


class ChatpipeError(Exception):
    """Root of every error chatpipe raises on purpose."""


class SchemaError(ChatpipeError):
    """A schema file is missing, unreadable or not valid Avro."""


class EncodeError(ChatpipeError):
    """A record does not fit its schema (wrong type, missing field)."""


class DecodeError(ChatpipeError):
    """Bytes that are not a record this build can read.

    Carries where the bytes came from, when known, so a dead-letter record or a log line can
    point at the exact message: ``topic``, ``partition`` and ``offset``.
    """

    def __init__(self, reason: str, *, topic: str | None = None, partition: int | None = None,
                 offset: int | None = None) -> None:
        self.reason, self.topic, self.partition, self.offset = reason, topic, partition, offset
        where = "" if topic is None else f" (topic {topic}, partition {partition}, offset {offset})"
        super().__init__(f"{reason}{where}")

    def at(self, topic: str | None, partition: int | None, offset: int | None) -> "DecodeError":
        """The same error, with the message's position filled in."""
        return type(self)(self.reason, topic=topic, partition=partition, offset=offset)


class UnknownSchemaError(DecodeError):
    """Well-formed single-object header, but its fingerprint names no schema we hold."""
