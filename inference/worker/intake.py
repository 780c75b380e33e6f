"""What both intake modes hand the worker, and what the worker hands back.

An intake runs its consumer(s) in its own thread(s): it takes records only while ``Capacity``
says there is room, decodes them, and passes ``WorkItem``s to the event loop. The worker calls
``finish(item, outcome)`` once the item's Response (or dead letter) is durable; the intake turns
that into an offset commit (partition) or an acknowledgement (share).

A thread of an intake that dies reports it through ``failed(exc)`` (on the event loop): the worker
cannot serve without it and stops (docs/worker.md, "Failure policy").
"""

from __future__ import annotations

import abc
import asyncio
import enum
import logging
from dataclasses import dataclass
from typing import Any, Callable

from inference.worker.capacity import Capacity
from inference.worker.settings import WorkerSettings
from schemas.codec import AvroCodec
from schemas.errors import DecodeError
from schemas.records import InferenceRequest, Priority
from schemas.topics import INFERENCE_REQUESTS, INFERENCE_REQUESTS_BATCH
from transport.message import ConsumedMessage
from transport.settings import KafkaSettings
from transport.spans import Tracer

log = logging.getLogger(__name__)


class Outcome(enum.Enum):
    DONE = "done"  # answered: commit / ACCEPT
    DEAD = "dead"  # dead-lettered: commit / REJECT
    HAND_BACK = "hand_back"  # not answered (shutdown, revoked, engine failure): no commit / RELEASE


@dataclass(eq=False)
class WorkItem:
    message: ConsumedMessage
    priority: Priority
    record: InferenceRequest | None = None
    # DecodeError (no record) or TooManyDeliveriesError (record when it decodes): dead-letter it
    error: Exception | None = None
    delivery_count: int | None = None  # share intake only
    taken_at_ms: int = 0
    # share intake: when the record's acquisition lock runs out (epoch ms, less a margin for the
    # Response and the ACCEPT): a generation still running then is stopped (finish TIMEOUT), else
    # the broker would give the record to another worker while it still runs here.
    lock_until_ms: int | None = None
    revoked: bool = False  # partition taken away: stop, answer nothing, commit nothing
    handed_back: bool = False  # shutdown: stop, answer nothing
    handle: Any = None  # the intake's own bookkeeping

    @property
    def partition(self) -> tuple[str, int]:
        return self.message.topic, self.message.partition


class Intake(abc.ABC):
    """What both intake modes share: their settings, ``taking`` (False once the worker stops taking
    work) and the way to the event loop (``start``'s callbacks)."""

    def __init__(self, kafka: KafkaSettings, settings: WorkerSettings, capacity: Capacity, codec: AvroCodec) -> None:
        self.kafka = kafka
        self.settings = settings
        self.capacity = capacity
        self.codec = codec
        self.tracer = Tracer("inference")  # the worker gives its own: a "receive" span per batch
        self.taking = True

    def start(self, loop: asyncio.AbstractEventLoop, dispatch: Callable[[WorkItem], None],
              revoked: Callable[[list[WorkItem]], None], failed: Callable[[BaseException], None]) -> None:
        """Take work: each item to ``dispatch``, revoked ones (partition) to ``revoked``, the error of
        a thread that died to ``failed``, all called on ``loop``."""
        self._loop, self._dispatch, self._revoked_cb, self._failed_cb = loop, dispatch, revoked, failed
        self._start_threads()

    @abc.abstractmethod
    def _start_threads(self) -> None: ...

    @abc.abstractmethod
    def finish(self, item: WorkItem, outcome: Outcome) -> None: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Stop, hand back what is not finished (blocking: run it off the event loop)."""

    def record_crash(self, item: WorkItem, reason: str) -> None:
        """``item``'s own handling raised a bug (the worker stops now): count it against the record,
        durably, so that the record is dead-lettered once it has crashed the worker too often
        (``crash_counts.py``). Here: nothing, for share mode, whose broker counts every delivery."""

    def stop_taking(self) -> None:
        self.taking = False
        self.capacity.notify()

    def hand_over(self, item: WorkItem) -> None:
        """``item`` to the worker (from an intake thread)."""
        self._loop.call_soon_threadsafe(self._dispatch, item)

    def report_failure(self, exc: BaseException) -> None:
        try:
            self._loop.call_soon_threadsafe(self._failed_cb, exc)
        except RuntimeError:  # the loop is closed: the worker has gone already
            pass


def request_topics(settings: KafkaSettings) -> dict[str, Priority]:
    """Real topic name -> the priority class it carries."""
    return {settings.topic(INFERENCE_REQUESTS): Priority.INTERACTIVE,
            settings.topic(INFERENCE_REQUESTS_BATCH): Priority.BATCH}


def decode_item(codec: AvroCodec, message: ConsumedMessage, priority: Priority, now_ms: int) -> WorkItem:
    """A WorkItem with the decoded request, or with the DecodeError to dead-letter."""
    item = WorkItem(message, priority, taken_at_ms=now_ms)
    try:
        if message.value is None:
            raise DecodeError("empty value (tombstone) where an InferenceRequest was expected",
                              topic=message.topic, partition=message.partition, offset=message.offset)
        item.record = codec.decode(message.value, InferenceRequest, topic=message.topic,
                                   partition=message.partition, offset=message.offset)
    except DecodeError as exc:
        item.error = exc
    return item
