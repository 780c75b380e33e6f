"""Cancels from ``chat.cancels``: every worker reads every partition (from the end, no group), since
only the worker running a generation can stop it. Runs in its own thread; each Cancel is handed
to the event loop. A Cancel for a request not seen yet is remembered (bounded), so a request
that arrives after its own Cancel is answered CANCELLED without running. If the thread dies,
``on_failure`` tells the worker, which stops: a worker that no longer hears Cancels would run
cancelled generations to the end. A record that is not a Cancel is handed to ``on_undecodable``
(the worker dead-letters it): every worker sees it, and each sends the same letter (one event id,
``transport.dead_letters.dead_letter_id``), so it is one fact on ``chat.dlq``.
"""

from __future__ import annotations

from collections import OrderedDict

from transport.broadcast import BroadcastListener
from transport.settings import IDLE_FETCH_WAIT_MS
from schemas.records import Cancel
from schemas.topics import CANCELS


class RecentCancels:
    """request_id -> reason of the last ``capacity`` cancels (oldest forgotten first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, str] = OrderedDict()

    def add(self, request_id: str, reason: str) -> None:
        self._ids[request_id] = reason
        self._ids.move_to_end(request_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def pop(self, request_id: str) -> str | None:
        return self._ids.pop(request_id, None)


class CancelListener(BroadcastListener):
    """Every Cancel of ``chat.cancels``, handed to the loop (``start(loop, on_cancel, on_failure, ...)``)."""

    # Bounds only an idle fetch: the broker answers a waiting one when a Cancel is appended
    # (bench/kafka_hop.py); 10 ms made every worker send ~100 empty fetches a second.
    topic, record_type, thread_name, fetch_wait_ms = CANCELS, Cancel, "chatpipe-cancels", IDLE_FETCH_WAIT_MS
