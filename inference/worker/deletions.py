"""Deletions from ``chat.deletions``: every worker reads every partition (from the end, no group),
since each worker's engine holds its own prefix cache, and drops the erased user's cached
prefixes (``AsyncEngine.forget_prefixes``), then acknowledges with a ``DeletionAudit`` on
``chat.deletions.audit`` (component ``inference.worker:<worker_id>``).

From the end: a fresh worker's cache is empty, so what was deleted before it started is not in
it. Runs in its own thread, like the cancel listener (``cancels.py``); each decoded Deletion is
handed to the event loop, which queues the forget on the engine's step thread. If the thread
dies, ``on_failure`` tells the worker, which stops: a worker that no longer hears deletions
would go on serving an erased user's prefixes. A record that is not a Deletion goes to
``on_undecodable`` (the worker dead-letters it; every worker sends the same letter, one event
id, so it is one fact on ``chat.dlq``).
"""

from __future__ import annotations

from collections import OrderedDict

from transport.broadcast import BroadcastListener
from transport.settings import IDLE_FETCH_WAIT_MS
from schemas.records import Deletion, DeletionAudit
from schemas.topics import DELETIONS


def audit_component(worker_id: str) -> str:
    """The store named in this worker's audits (contract C3): its engine's prefix cache."""
    return f"inference.worker:{worker_id}"


def prefix_cache_audit(deletion: Deletion, worker_id: str) -> DeletionAudit:
    """The acknowledgement of one Deletion carried out on this worker's prefix cache. The cache
    holds no memory points or conversation state (those counts are 0); the blocks dropped go to
    the worker's log."""
    return DeletionAudit(deletion_event_id=deletion.event_id, scope=deletion.scope, user_id=deletion.user_id,
                         tenant=deletion.tenant, conversation_id=deletion.conversation_id, memory_points_deleted=0,
                         conversations_cleared=0, component=audit_component(worker_id),
                         requested_at=deletion.created_at)


class RecentDeletions:
    """(tenant, user_id) -> created_at of the latest Deletion of the last ``capacity`` users, so a
    request created before its user's deletion but served after it (it waited in the backlog)
    caches none of its prefix blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._at: OrderedDict[tuple[str, str], int] = OrderedDict()

    def add(self, deletion: Deletion) -> None:
        key = (deletion.tenant, deletion.user_id)
        self._at[key] = max(deletion.created_at, self._at.get(key, 0))
        self._at.move_to_end(key)
        while len(self._at) > self.capacity:
            self._at.popitem(last=False)

    def covers(self, tenant: str, user_id: str, created_at: int) -> bool:
        at = self._at.get((tenant, user_id))
        return at is not None and created_at <= at


class DeletionListener(BroadcastListener):
    """Every Deletion of ``chat.deletions``, handed to the loop (``start(loop, on_deletion, on_failure, ...)``)."""

    topic, record_type, thread_name, fetch_wait_ms = DELETIONS, Deletion, "chatpipe-deletions", IDLE_FETCH_WAIT_MS
