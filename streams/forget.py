"""The forget agent: ``chat.deletions`` -> memory points and conversation state removed, audited.

A ``Deletion`` of scope USER forgets every conversation of that tenant's user; scope
CONVERSATION one conversation. Both the Qdrant points (``ConversationMemory.forget``) and the
table entries (recent turns, pending requests, counters) go, under the shared state lock so no
agent writes a forgotten conversation back. Then a ``DeletionAudit`` goes to
``chat.deletions.audit`` (how many points and conversations were removed) and a log line says
the same. A response still in flight for a forgotten conversation finds no pending request
afterwards and is dead-lettered (``UnknownRequestError``), never remembered.

Deletions are taken in small batches and acked only after their audits are on the broker: a
Qdrant or broker fault is retried, and past the retry budget nothing is acked and the process
exits (``faults.py``), so the Deletion is carried out again after the restart. Forgetting is
idempotent; only the audit of such a repeat counts what was left (0 points when the first run
had deleted them before the fault).

Not here: the Avro archive and ``chat.turns`` keep their records (retention and the Spark jobs
govern those; docs/streams.md).
"""

from __future__ import annotations

import logging
from typing import Any

from schemas.errors import DecodeError
from schemas.records import Deletion, DeletionAudit, DeletionScope
from streams.acks import Batches
from streams.dead_letters import DeadLetters, child_headers
from streams.errors import InvalidDeletionError
from streams.faults import Retrier
from streams.outbox import Outbox
from streams.services import StreamsServices

log = logging.getLogger(__name__)
COMPONENT = "streams.forget"
#: Deletions are rare: small batches, a short wait. Handled one after another within a batch.
BATCH, WITHIN_S = 16, 0.05


def matches(value: dict, deletion: Deletion) -> bool:
    """Whether a conversation-state table value falls under ``deletion``."""
    if value.get("tenant") != deletion.tenant or value.get("user_id") != deletion.user_id:
        return False
    return deletion.scope == DeletionScope.USER or value.get("conversation_id") == deletion.conversation_id


class Forget:
    def __init__(self, services: StreamsServices, table: Any, audit_topic: Any, dead_letters: DeadLetters,
                 retrier: Retrier) -> None:
        self.services = services
        self.retrier = retrier
        self.table = table
        self.audit_topic = audit_topic
        self.dead_letters = dead_letters
        self.carried_out = 0

    async def __call__(self, stream: Any) -> None:
        batches = Batches(stream, BATCH, WITHIN_S)
        async for events in batches:
            outbox = Outbox(self.retrier)
            for event in events:
                await self.handle(event, outbox)
            await outbox.deliver()
            await batches.ack(events)

    async def handle(self, event: Any, outbox: Outbox) -> None:
        m = event.message
        try:
            deletion = self.services.codec.decode(m.value, Deletion, topic=m.topic, partition=m.partition,
                                                  offset=m.offset)
            if deletion.scope == DeletionScope.CONVERSATION and not deletion.conversation_id:
                raise InvalidDeletionError(f"Deletion {deletion.event_id}: scope CONVERSATION without a "
                                           "conversation_id")
            if not deletion.tenant.strip() or not deletion.user_id.strip():
                raise InvalidDeletionError(f"Deletion {deletion.event_id}: empty tenant or user_id "
                                           f"({deletion.tenant!r}, {deletion.user_id!r})")
        except (DecodeError, InvalidDeletionError) as exc:
            await self.dead_letters.send(event, exc, outbox)
            return
        conversation = deletion.conversation_id if deletion.scope == DeletionScope.CONVERSATION else None
        async with self.services.state_lock:
            points = await self.retrier.call(
                "memory forget", self.services.in_memory_thread, self.services.memory.forget,
                tenant=deletion.tenant, user_id=deletion.user_id, conversation_id=conversation)
            keys = [key for key, value in list(self.table.items()) if value is not None and matches(value, deletion)]
            for key in keys:
                del self.table[key]
        audit = DeletionAudit(deletion_event_id=deletion.event_id, scope=deletion.scope, user_id=deletion.user_id,
                              tenant=deletion.tenant, conversation_id=conversation, memory_points_deleted=points,
                              conversations_cleared=len(keys), component=COMPONENT,
                              requested_at=deletion.created_at)
        await outbox.send(self.audit_topic, key=deletion.user_id.encode(), value=self.services.codec.encode(audit),
                          headers=child_headers(m))
        self.carried_out += 1
        log.info("forgot %s %s/%s%s: %d memory points, %d conversations (deletion %s)", deletion.scope,
                 deletion.tenant, deletion.user_id, f"/{conversation}" if conversation else "", points, len(keys),
                 deletion.event_id)
