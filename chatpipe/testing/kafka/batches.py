"""The decoded record the test consumer (``chatpipe.testing.kafka.consumer.BatchConsumer``) hands out.
How it builds batches cheaply (``wrap_batch``, ``pause_gc``) is ``transport/batches.py``: the
services' ``GroupConsumer`` builds its batches the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transport.message import ConsumedMessage


@dataclass(frozen=True, slots=True)
class DecodedMessage:
    record: Any
    message: ConsumedMessage
