"""The deletion log read whole: every ``Deletion`` on ``chat.deletions`` now (the topic is kept forever: the
source of truth for erasures). Read by the streams tier's erasure registry at its start, by ``chatpipe forget
--verify`` and by a publishing training run (rows of users erased since a dataset's build are left out).

A tombstone or a record that does not decode is skipped here: the streams tier's forget agent dead-letters
such a record when it consumes it, with the reason.
"""

from __future__ import annotations

from typing import Any

from schemas.codec import AvroCodec, default_codec
from schemas.errors import DecodeError
from schemas.records import Deletion
from schemas.topics import DELETIONS
from transport.topic_scan import read_to_end


def read_deletions(kafka: Any, codec: AvroCodec | None = None, timeout_s: float = 30.0) -> list[Deletion]:
    """Every deletion on the topic now, in the order read (partition by partition)."""
    codec = codec or default_codec()
    deletions: list[Deletion] = []

    def take(message: Any) -> None:
        if message.value() is None:
            return
        try:
            deletions.append(codec.decode(message.value(), Deletion))
        except DecodeError:
            pass

    read_to_end(kafka, kafka.topic(DELETIONS), take, timeout_s=timeout_s)
    return deletions
