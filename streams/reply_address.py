"""Is a PromptRequest's reply address one that can be answered? Checked where requests enter.

A ``reply_to`` that is not a topic, or a ``reply_partition`` outside it, cannot receive a single
chunk: the inference worker's send would fail on every delivery of the request (issue 18), and
intake's own error chunk could not go there either. So intake refuses such a request with a
dead letter alone.

The broker's topic list is cached for ``cache_s``: a known address costs a dict lookup. Reply
topics are created by their readers at any time (a gateway starting, then producing), so an
address the list does not know is looked up again unless the list was taken after the request
was produced (plus ``CLOCK_SLACK_S`` for clocks that disagree): a topic created before its first
request is always found, and a flood of bad addresses costs a lookup only for requests newer
than the last one. Listing the topics is blocking admin I/O: it runs in a thread, and its
failure (broker away) raises ``TransportError``, a fault of the infrastructure, not of the request.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

#: How far the producer's clock (the record timestamp) may run ahead of ours.
CLOCK_SLACK_S = 1.0


class ReplyAddresses:
    def __init__(self, list_topics: Callable[[], dict[str, int]], cache_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self._list_topics = list_topics  # topic name -> partitions, e.g. TopicAdmin.topic_partitions
        self.cache_s = cache_s
        self._clock = clock  # wall clock, seconds: compared with record timestamps
        self._partitions: dict[str, int] = {}
        self._listed_at: float | None = None

    async def problem(self, reply_to: str | None, partition: int | None, *, sent_at_s: float | None = None,
                      fresh: bool = False) -> str | None:
        """Why nobody can be answered at this address, or None when it works (or there is none).

        ``sent_at_s``: when the request was produced (its record timestamp, epoch seconds); None
        looks an unknown address up again whatever the list's age. ``fresh`` looks the topics up
        now whatever the cache holds (after a send there failed).
        """
        if reply_to is None:
            return None  # no reply address: the asker reads chat.responses, nothing to check
        if not reply_to.strip():
            return "reply_to is empty"
        if partition is not None and partition < 0:
            return f"reply_partition {partition} is negative"
        now = self._clock()
        if fresh or self._listed_at is None or now - self._listed_at > self.cache_s:
            await self._refresh()
        elif self._why_not(reply_to, partition) and (sent_at_s is None
                                                     or self._listed_at < sent_at_s + CLOCK_SLACK_S):
            await self._refresh()  # perhaps created after the last look, before the request
        return self._why_not(reply_to, partition)

    def _why_not(self, reply_to: str, partition: int | None) -> str | None:
        count = self._partitions.get(reply_to)
        if count is None:
            return f"reply_to {reply_to!r} is not a topic on the broker"
        if partition is not None and partition >= count:
            return f"reply_partition {partition} is outside {reply_to!r}, which has {count} partition(s)"
        return None

    async def _refresh(self) -> None:
        self._partitions = await asyncio.to_thread(self._list_topics)
        self._listed_at = self._clock()
