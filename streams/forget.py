"""The forget agent: ``chat.deletions`` -> memory, conversation state and archive erased, audited.

A ``Deletion`` of scope USER forgets every conversation of that tenant's user; scope
CONVERSATION one conversation; either erases what was created at or before its ``created_at``.
In order:

1. the deletion goes into the ``ErasureRegistry`` first: from then on the record agent does not
   remember, and the archive does not archive, a record it erases that is still on its way
   (a response in flight, turns the archive has not read yet);
2. the Qdrant points (``ConversationMemory.forget``) and the table entries (recent turns,
   pending requests, counters) go, under the shared state lock so no agent writes a forgotten
   conversation back; a ``DeletionAudit`` with component ``streams.forget`` says how many;
3. the archive files of ``chat.turns`` and ``chat.feedback`` holding the subject's records are
   rewritten without them (``Archiver.erase``: atomically, the archiver's lock taken per file); a second
   ``DeletionAudit``, component ``streams.archive`` (``conversations_cleared`` = conversations
   whose archived records were removed; the log line has records and files);
4. the deletions themselves are archived under ``<archive>/chat.deletions/`` (never rewritten:
   the dataset job reads them to exclude erased users from every later build).

A response still in flight for a forgotten conversation finds no pending request afterwards and
is dead-lettered (``UnknownRequestError``), never remembered.

Deletions are taken in small batches and acked only after their audits are on the broker: a
Qdrant or broker fault is retried, and past the retry budget nothing is acked and the process
exits (``faults.py``), so the Deletion is carried out again after the restart. Forgetting is
idempotent; only the audit of such a repeat counts what was left (0 points when the first run
had deleted them before the fault).

Not here: the topics (``chat.turns``, ``chat.feedback``, ...) keep their copies until retention
removes them, datasets are the dataset job's, the prefix cache the inference worker's
(docs/privacy.md has every store's guarantee and time).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Sequence

from schemas.errors import DecodeError
from schemas.records import Deletion, DeletionAudit, DeletionScope
from streams.acks import Batches
from streams.archive import Archiver, archived_message
from streams.dead_letters import DeadLetters, child_headers
from streams.erasures import ErasureRegistry, Subject
from streams.errors import InvalidDeletionError
from streams.faults import Retrier
from streams.outbox import Outbox
from streams.services import StreamsServices

log = logging.getLogger(__name__)
COMPONENT = "streams.forget"
ARCHIVE_COMPONENT = "streams.archive"
#: Deletions are rare: small batches, a short wait. Handled one after another within a batch.
BATCH, WITHIN_S = 16, 0.05


def matches(value: dict, deletion: Deletion) -> bool:
    """Whether a conversation-state table value falls under ``deletion``."""
    if value.get("tenant") != deletion.tenant or value.get("user_id") != deletion.user_id:
        return False
    return deletion.scope == DeletionScope.USER or value.get("conversation_id") == deletion.conversation_id


class Forget:
    def __init__(self, services: StreamsServices, table: Any, audit_topic: Any, dead_letters: DeadLetters,
                 retrier: Retrier, *, archiver: Archiver | None = None, archive_topics: Sequence[str] = (),
                 archive_retrier: Retrier | None = None, erasures: ErasureRegistry | None = None) -> None:
        self.services = services
        self.retrier = retrier
        self.table = table
        self.audit_topic = audit_topic
        self.dead_letters = dead_letters
        self.archiver = archiver  # None: no archive in this process (nothing to rewrite or archive)
        self.archive_topics = tuple(archive_topics)  # real names (with the prefix) of the rewritten topics
        self.archive_retrier = archive_retrier or retrier
        self.erasures = erasures if erasures is not None else (archiver.erasures if archiver else ErasureRegistry())
        self.carried_out = 0

    async def __call__(self, stream: Any) -> None:
        batches = Batches(stream, BATCH, WITHIN_S)
        async for events in batches:
            outbox = Outbox(self.retrier)
            for event in events:
                await self.handle(event, outbox)
            if self.archiver is not None:  # the deletion log itself, for the dataset job (never rewritten)
                await self.archive_retrier.call("archive deletions", asyncio.to_thread, self.archiver.write,
                                                [archived_message(e) for e in events])
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
        self.erasures.add(deletion)  # first: whatever is written after this is checked against it
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
        log.info("forgot %s %s/%s%s: %d memory points, %d conversations (deletion %s)", deletion.scope,
                 deletion.tenant, deletion.user_id, f"/{conversation}" if conversation else "", points, len(keys),
                 deletion.event_id)
        if self.archiver is not None:
            await self._erase_archive(deletion, m, outbox)
        self.carried_out += 1

    async def _erase_archive(self, deletion: Deletion, message: Any, outbox: Outbox) -> None:
        subject = Subject.of(deletion)
        # fsyncs and deflate off the event loop; the archive agent's writes wait on the same lock
        erased = await self.archive_retrier.call("archive erase", asyncio.to_thread, self.archiver.erase,
                                                 self.archive_topics, subject, deletion.created_at)
        audit = DeletionAudit(deletion_event_id=deletion.event_id, scope=deletion.scope, user_id=deletion.user_id,
                              tenant=deletion.tenant, conversation_id=subject.conversation_id,
                              memory_points_deleted=0, conversations_cleared=len(erased.conversations),
                              component=ARCHIVE_COMPONENT, requested_at=deletion.created_at)
        await outbox.send(self.audit_topic, key=deletion.user_id.encode(), value=self.services.codec.encode(audit),
                          headers=child_headers(message))
        log.info("erased %s/%s%s from the archive: %d record(s) of %d conversation(s) removed, %d of %d file(s) "
                 "rewritten in %.3f s (deletion %s)", deletion.tenant, deletion.user_id,
                 f"/{subject.conversation_id}" if subject.conversation_id else "", erased.records_removed,
                 len(erased.conversations), erased.files_rewritten, erased.files_scanned, erased.seconds,
                 deletion.event_id)
