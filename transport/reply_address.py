"""The one rule for reply addresses: can a request's ``reply_to`` / ``reply_partition`` be answered?

Any application producing to ``chat.prompts`` names its own reply address. Streams intake checks
it where requests enter (a refused request gets a dead letter alone: no chunk can reach its
asker), the inference worker checks it again before generating (``ReplyAddressError``), and both
ask ``ReplyAddresses.problem``, so a request refused by one is refused by the other for the same
reason.

``name_problem`` is the pure half: a name that is not a Kafka topic name, or one of the
pipeline's own catalog topics (``schemas.topics.CATALOG``, with the deployment's prefix) other
than ``chat.replies``, is never a reply address. Chunks on ``chat.prompts`` or
``chat.inference.requests`` would come back as poison records of the wrong type; on
``chat.responses``, ``chat.turns``, ... they would corrupt a stream others read.
``chat.replies`` and ``chat.replies.<gateway id>`` (not in the catalog) are reply topics.

The broker half: the topic must exist and the partition must be inside it. Partition counts
come from the broker's metadata (``TopicAdmin.topic_partitions``, blocking: run in a thread),
cached: a known-good address is re-read after ``fresh_s``; an address the list does not know is
looked up again when the list was taken before the request was produced (``sent_at_s``, plus
``CLOCK_SLACK_S`` for clocks that disagree: a topic created before its first request is always
found), or, with no ``sent_at_s``, when the list is older than ``recheck_s`` (a flood of bad
records costs one metadata request per ``recheck_s``). One lookup at a time. While the broker's
metadata cannot be read, an address known good is used as it was; one never seen raises
``TransportError``: the infrastructure's fault, not the record's (``transport.failures``).

Errors of a send to a reply address are classified by ``transport.failures.classify(exc,
address_from_record=True)``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Callable

from schemas.topics import CATALOG, REPLIES
from transport.errors import TransportError
from transport.settings import KafkaSettings

log = logging.getLogger(__name__)

#: How far the producer's clock (the record timestamp) may run ahead of ours.
CLOCK_SLACK_S = 1.0
# Kafka's own rule for topic names (org.apache.kafka.common.internals.Topic).
_TOPIC_NAME = re.compile(r"[a-zA-Z0-9._-]{1,249}")


def reserved_topics(prefix: str = "") -> frozenset[str]:
    """The catalog topics that are never a reply address (every one but ``chat.replies``)."""
    return frozenset(prefix + spec.name for spec in CATALOG if spec.name != REPLIES)


def name_problem(reply_to: str, partition: int | None, reserved: frozenset[str] = frozenset()) -> str | None:
    """Why ``reply_to`` / ``partition`` can never be a reply address, whatever the broker holds;
    None when it may be one."""
    if not reply_to.strip():
        return "reply_to is empty"
    if not _TOPIC_NAME.fullmatch(reply_to) or reply_to in (".", ".."):
        return f"reply_to {reply_to!r} is not a valid Kafka topic name"
    if reply_to in reserved:
        return f"reply_to {reply_to} is a topic of the pipeline itself, not a reply topic"
    if partition is not None and partition < 0:
        return f"reply_partition {partition} is negative"
    return None


class ReplyAddresses:
    """Checks reply addresses: ``name_problem``, then the broker's topics (cached, see above)."""

    def __init__(self, list_partitions: Callable[[], dict[str, int]], *, reserved: frozenset[str] = frozenset(),
                 fresh_s: float = 30.0, recheck_s: float = 1.0, clock: Callable[[], float] = time.time) -> None:
        self._list = list_partitions  # blocking: {topic: partition count}; raises TransportError
        self.reserved = reserved
        self.fresh_s = fresh_s
        self.recheck_s = recheck_s
        self._clock = clock  # wall clock, seconds: compared with record timestamps
        self._counts: dict[str, int] = {}
        self._read_at: float | None = None
        self._lock = asyncio.Lock()

    @classmethod
    def of(cls, kafka: KafkaSettings, list_partitions: Callable[[], dict[str, int]], **kwargs) -> "ReplyAddresses":
        """For a deployment: the catalog topics under its prefix are reserved."""
        return cls(list_partitions, reserved=reserved_topics(kafka.topic_prefix), **kwargs)

    async def problem(self, reply_to: str | None, partition: int | None, *, sent_at_s: float | None = None,
                      fresh: bool = False) -> str | None:
        """Why nobody can be answered at this address, or None when it works (or there is none).

        ``sent_at_s``: when the request was produced (its record timestamp, epoch seconds).
        ``fresh``: look the topics up now whatever the cache holds (after a send there failed).
        """
        if reply_to is None:
            return None  # no reply address: the asker reads chat.responses, nothing to check
        if problem := name_problem(reply_to, partition, self.reserved):
            return problem
        if fresh or self._stale(reply_to, partition, sent_at_s):
            await self._refresh(reply_to, partition, forced=fresh)
        count = self._counts.get(reply_to)
        if count is None:
            return f"reply_to {reply_to!r} is not a topic on the broker"
        if partition is not None and partition >= count:
            return (f"reply_partition {partition} is outside {reply_to!r}, which has {count} partition(s): "
                    f"0-{count - 1}")
        return None

    def _good(self, reply_to: str, partition: int | None) -> bool:
        count = self._counts.get(reply_to)
        return count is not None and (partition is None or partition < count)

    def _stale(self, reply_to: str, partition: int | None, sent_at_s: float | None) -> bool:
        if self._read_at is None:
            return True
        age = self._clock() - self._read_at
        if self._good(reply_to, partition):
            return age > self.fresh_s
        if sent_at_s is not None:  # perhaps created after the last look, before the request
            return self._read_at < sent_at_s + CLOCK_SLACK_S or age > self.fresh_s
        return age >= self.recheck_s

    async def _refresh(self, reply_to: str, partition: int | None, *, forced: bool) -> None:
        read_at = self._read_at
        async with self._lock:  # one metadata request at a time, however many requests wait
            if self._read_at != read_at and not forced:
                return  # another request read the list while this one waited
            try:
                counts = await asyncio.to_thread(self._list)
            except TransportError:
                if self._good(reply_to, partition) and not forced:
                    log.warning("metadata for reply topic %s not read; using what was read before", reply_to,
                                exc_info=True)
                    return  # the broker is away for now, and this address was fine: go on with it
                raise  # nothing known of it: the infrastructure's fault, not the record's
            self._counts, self._read_at = counts, self._clock()
