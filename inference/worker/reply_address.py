"""Can the worker write to a request's reply address? Checked before it generates anything, and
used to tell a failed chunk send that is the request's fault from one that is the broker's.

Any application producing to ``chat.prompts`` names its own ``reply_to`` / ``reply_partition``.
A partition outside the topic made the chunk send raise ``KafkaException(_UNKNOWN_PARTITION)``,
which the worker took for a broker failure: it exited without committing, and every restarted
worker died on the same record. So:

- ``ReplyAddresses.check`` refuses, with ``ReplyAddressError``, a name that is not a topic name,
  one of the worker's own input topics (chunks there would come back as poison records), a
  topic the broker does not have, a partition outside it. Partition counts come from the
  broker's metadata, cached: a known-good address is re-read after ``fresh_s``, a bad one after
  ``recheck_s`` at most (a topic created a moment ago is found on the next look; a flood of bad
  records costs one metadata request per ``recheck_s``). While the broker's metadata cannot be
  read, an address known good is used as it was; one never seen is the infrastructure's fault
  (``TransportError``), not the record's.
- ``is_reply_fault`` classifies an error of a chunk send by its Kafka error code: the address
  went bad after the check (topic deleted), or the broker refuses the record (too large,
  invalid, not authorised for that topic) -> the record's fault. Anything else (timeouts, all
  brokers down) -> the infrastructure's.

Not here: what to answer (``worker.py``), producing (``transport.acked_producer``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Callable, Collection

from confluent_kafka import KafkaError, KafkaException

from inference.worker.errors import ReplyAddressError
from schemas.records import InferenceRequest
from transport.errors import DeliveryError, TransportError

log = logging.getLogger(__name__)

# Kafka's own rule for topic names (org.apache.kafka.common.internals.Topic).
_TOPIC_NAME = re.compile(r"[a-zA-Z0-9._-]{1,249}")

# Errors of a reply send that are the request's fault: retrying the same record cannot succeed.
REPLY_FAULT_CODES = frozenset({
    KafkaError._UNKNOWN_PARTITION,  # partition outside the topic
    KafkaError._UNKNOWN_TOPIC,  # librdkafka: the topic is not in the cluster's metadata
    KafkaError.UNKNOWN_TOPIC_OR_PART,  # broker: the same, after librdkafka's own retries
    KafkaError.TOPIC_EXCEPTION,  # invalid topic name
    KafkaError.TOPIC_AUTHORIZATION_FAILED,  # a topic this worker may not write to
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.INVALID_MSG_SIZE,
    KafkaError.INVALID_RECORD,
    KafkaError.INVALID_MSG,
})

def error_code(exc: BaseException) -> int | None:
    """The Kafka error code behind ``exc`` (a produce-time ``KafkaException`` or a delivery report's
    ``DeliveryError``), or None when it has none."""
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0].code()
    if isinstance(exc, DeliveryError):
        return exc.code
    return None


def is_reply_fault(exc: BaseException) -> bool:
    """True when a failed send to a reply address is the request's fault (see REPLY_FAULT_CODES)."""
    return error_code(exc) in REPLY_FAULT_CODES


class ReplyAddresses:
    """Checks reply addresses against the broker's topics (cached, see the module docstring)."""

    def __init__(self, list_partitions: Callable[[], dict[str, int]], *, own_topics: Collection[str] = (),
                 fresh_s: float = 30.0, recheck_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._list = list_partitions  # blocking: {topic: partition count}, raises TransportError
        self._own = frozenset(own_topics)
        self._fresh_s = fresh_s
        self._recheck_s = recheck_s
        self._clock = clock
        self._counts: dict[str, int] = {}
        self._read_at = float("-inf")
        self._lock = asyncio.Lock()

    async def check(self, req: InferenceRequest) -> None:
        """Raises ``ReplyAddressError`` when chunks for ``req`` could never be delivered."""
        topic, partition = req.reply_to, req.reply_partition
        if not topic:
            return  # no reply address: no chunks are sent, only the Response
        if not _TOPIC_NAME.fullmatch(topic) or topic in (".", ".."):
            raise ReplyAddressError(f"reply_to {topic!r} is not a valid Kafka topic name")
        if topic in self._own:
            raise ReplyAddressError(f"reply_to {topic} is a request topic of the inference workers")
        if partition is not None and partition < 0:
            raise ReplyAddressError(f"reply_partition {partition} is negative")
        count = await self._partitions(topic, partition)
        if count is None:
            raise ReplyAddressError(f"reply topic {topic} does not exist on the broker")
        if partition is not None and partition >= count:
            raise ReplyAddressError(f"reply_partition {partition} is outside reply topic {topic} "
                                    f"({count} partition(s): 0-{count - 1})")

    async def _partitions(self, topic: str, partition: int | None) -> int | None:
        for _ in range(2):  # the cached answer, then (when it says no or is old) a fresh one
            count = self._counts.get(topic)
            good = count is not None and (partition is None or partition < count)
            age = self._clock() - self._read_at
            if age < (self._fresh_s if good else self._recheck_s):
                return count
            async with self._lock:  # one metadata request at a time, however many requests wait
                if self._clock() - self._read_at >= self._recheck_s:
                    try:
                        self._counts = await asyncio.to_thread(self._list)
                    except TransportError:
                        if good:  # the broker is away for now, and this address was fine: go on with it
                            log.warning("metadata for reply topic %s not read; using what was read %.0f s ago",
                                        topic, age, exc_info=True)
                            return count
                        raise  # nothing known of it: the infrastructure's fault, not the record's
                    self._read_at = self._clock()
        return self._counts.get(topic)
