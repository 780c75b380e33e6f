"""The forget agents: ``chat.deletions`` -> memory, conversation state and archive erased, audited.

A ``Deletion`` of scope USER forgets every conversation of that tenant's user; scope
CONVERSATION one conversation; either erases what was created at or before its ``created_at``.
A user's conversations are spread over every partition of the conversation topics, and with
several streams workers over several workers' tables; so a deletion is carried out in two steps:

1. ``Forget`` reads ``chat.deletions`` (keyed by user, 3 partitions: its partitions may be owned by
   any worker). It checks the deletion (else a dead letter), registers it in this worker's
   ``ErasureRegistry``, and sends one copy to **every partition** of the fan-out topic
   ``chat.deletions.fanout`` (a catalog topic, partitioned like ``chat.prompts``). After the batch, the deletions
   themselves are archived under ``<archive>/chat.deletions/`` (never rewritten: the dataset job reads
   them to exclude erased users from every later build).
2. ``ForgetPartition`` reads the fan-out topic: partition ``p`` goes to the worker that owns partition
   ``p`` of ``chat.prompts``, ``chat.responses``, ``chat.turns`` and the table (one co-partitioned
   group). Per copy, in order:
   a. the deletion goes into this worker's registry first: from then on its record agent does not
      remember, and its archive does not archive, a record it erases that is still on its way (a
      response in flight, turns the archive has not read yet);
   b. the Qdrant points (``ConversationMemory.forget``, by filter: the first partition's step finds
      them, the others 0, and any a worker remembered meanwhile; no lock held: the memory writer
      deletes what it upserts for a subject the registry erased meanwhile), then, under the shared
      state lock a chunk of keys at a time (so no agent writes a forgotten conversation back), the
      table entries of partition ``p`` (recent turns, pending requests, counters); a
      ``DeletionAudit`` with component ``streams.forget`` says how many;
   c. the archive files of partition ``p`` of ``chat.turns`` and ``chat.feedback`` holding the subject's
      records are rewritten without them (``Archiver.erase``: atomically, the archiver's lock taken per
      file); a second ``DeletionAudit``, component ``streams.archive`` (``conversations_cleared`` =
      conversations whose archived records were removed; the log line has records and files).

   So a deletion has one ``streams.forget`` and one ``streams.archive`` audit per partition (6 each):
   their sums are the deletion's counts, and all 6 present means every partition carried it out.

Model versions (``model_taint.py``) are not partitioned either: ``Forget`` marks every version trained on the
subject's erased rows TAINTED on ``chat.models``, once per deletion, and audits it once, component
``streams.models``, ``conversations_cleared`` = versions tainted.

The response cache (``response_cache.py``) is not partitioned: ``Forget`` erases the user's entries
once per deletion (every entry the user owns, for a conversation's deletion too: an entry's context
may hold turns recalled from any of their conversations), before the fan-out, within the retry
budget (Redis away: the batch is not acked), and audits it once, component
``streams.response-cache``, ``conversations_cleared`` = entries removed. Intake never serves an entry
of a user erased after it was written, deleted yet or not (the registry's second look).

Every worker also follows ``chat.deletions`` in full (``streams/app.py``, the registry's follower), so
a partition taken over after a rebalance is guarded against deletions another worker carried out.

A response still in flight for a forgotten conversation finds no pending request afterwards and
is dead-lettered (``UnknownRequestError``), never remembered.

Both agents take small batches and ack them only after what they sent is on the broker: a Qdrant or
broker fault is retried, and past the retry budget nothing is acked and the process exits
(``faults.py``), so the step is carried out again after the restart. Forgetting is idempotent; only
the audit of such a repeat counts what was left (0 points when the first run had deleted them).

No Faust here: each agent's ``handle`` takes a batch's messages and an outbox (``streams/ports.py``),
the table is a mapping; the Faust agents that feed them are ``faust_runtime.agents.faust_agent``.

Not here: the topics (``chat.turns``, ``chat.feedback``, ...) keep their copies until retention
removes them, datasets are the dataset job's, the prefix cache the inference worker's
(docs/privacy.md has every store's guarantee and time).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Sequence

from schemas.errors import DecodeError
from schemas.models import model_key
from schemas.records import Deletion, DeletionAudit, DeletionScope
from streams.archive import Archiver, archived_message
from streams.dead_letters import DeadLetters, child_headers
from streams.erasures import ErasureRegistry, Subject
from streams.errors import InvalidDeletionError
from streams.faults import Retrier
from streams.model_taint import COMPONENT as MODEL_TAINT_COMPONENT
from streams.model_taint import ModelTaint
from streams.ports import BatchRule, Message, Outbox
from streams.response_cache import ResponseCache
from streams.services import StreamsServices
from streams.table import key_partition

log = logging.getLogger(__name__)
COMPONENT = "streams.forget"
ARCHIVE_COMPONENT = "streams.archive"
CACHE_COMPONENT = "streams.response-cache"
MODELS_COMPONENT = MODEL_TAINT_COMPONENT
#: Deletions are rare: small batches, a short wait. Handled one after another within a batch.
BATCH, WITHIN_S = 16, 0.05
SCAN_CHUNK = 1000  # table keys scanned per hold of the state lock (as the idle sweep, expiry.py)


def matches(value: dict, deletion: Deletion) -> bool:
    """Whether a conversation-state table value falls under ``deletion``."""
    if value.get("tenant") != deletion.tenant or value.get("user_id") != deletion.user_id:
        return False
    return deletion.scope == DeletionScope.USER or value.get("conversation_id") == deletion.conversation_id


def decode_deletion(codec: Any, message: Any) -> Deletion:
    """The ``Deletion`` of a message, checked; ``DecodeError`` / ``InvalidDeletionError`` otherwise."""
    deletion = codec.decode(message.value, Deletion, topic=message.topic, partition=message.partition,
                            offset=message.offset)
    if deletion.scope == DeletionScope.CONVERSATION and not deletion.conversation_id:
        raise InvalidDeletionError(f"Deletion {deletion.event_id}: scope CONVERSATION without a conversation_id")
    if not deletion.tenant.strip() or not deletion.user_id.strip():
        raise InvalidDeletionError(f"Deletion {deletion.event_id}: empty tenant or user_id "
                                   f"({deletion.tenant!r}, {deletion.user_id!r})")
    return deletion


class _DeletionAgent:
    """What both agents do with a batch: each Deletion checked (else a dead letter) and carried out,
    the batch's records delivered, then the batch acked."""

    batching = BatchRule(BATCH, WITHIN_S)

    def __init__(self, services: StreamsServices, partitions: int, dead_letters: DeadLetters, retrier: Retrier,
                 archiver: Archiver | None, archive_retrier: Retrier | None, erasures: ErasureRegistry | None) -> None:
        self.services = services
        self.partitions = partitions
        self.dead_letters = dead_letters
        self.retrier = retrier
        self.archiver = archiver  # None: no archive in this process
        self.archive_retrier = archive_retrier or retrier
        self.erasures = erasures if erasures is not None else (archiver.erasures if archiver else ErasureRegistry())

    async def handle(self, messages: Sequence[Message], outbox: Outbox) -> None:
        for m in messages:
            try:
                deletion = decode_deletion(self.services.codec, m)
            except (DecodeError, InvalidDeletionError) as exc:
                await self.dead_letters.send(m, exc, outbox)
                continue
            await self.carry_out(deletion, m, outbox)
        await self.after_batch(messages)

    async def carry_out(self, deletion: Deletion, message: Message, outbox: Outbox) -> None:
        raise NotImplementedError

    async def _audit(self, deletion: Deletion, message: Any, outbox: Outbox, component: str,
                     conversation_id: str | None, points: int, conversations: int) -> None:
        """The ``DeletionAudit`` of what ``component`` erased for ``deletion`` on this partition."""
        audit = DeletionAudit(deletion_event_id=deletion.event_id, scope=deletion.scope, user_id=deletion.user_id,
                              tenant=deletion.tenant, conversation_id=conversation_id, memory_points_deleted=points,
                              conversations_cleared=conversations, component=component,
                              requested_at=deletion.created_at)
        await outbox.send(self.audit_topic, key=deletion.user_id.encode(), value=self.services.codec.encode(audit),
                          headers=child_headers(message))

    async def after_batch(self, messages: Sequence[Message]) -> None:
        """Before the batch's records are delivered and it is acked."""


class Forget(_DeletionAgent):
    """``chat.deletions`` -> the user's response-cache entries erased (audited); one copy per conversation
    partition on the fan-out topic; deletions archived."""

    def __init__(self, services: StreamsServices, fanout_topic: Any, partitions: int, dead_letters: DeadLetters,
                 retrier: Retrier, *, archiver: Archiver | None = None, archive_retrier: Retrier | None = None,
                 erasures: ErasureRegistry | None = None, cache: ResponseCache | None = None,
                 audit_topic: Any = None, models: ModelTaint | None = None, models_topic: Any = None) -> None:
        # archiver None: the deletions are not archived; cache None: no response cache; models None: no registry
        super().__init__(services, partitions, dead_letters, retrier, archiver, archive_retrier, erasures)
        self.fanout_topic = fanout_topic
        self.cache = cache
        self.audit_topic = audit_topic  # for the cache's audit
        self.fanned_out = 0
        self.cache_entries_erased = 0
        self.models = models
        self.models_topic = models_topic
        self.versions_tainted = 0

    async def after_batch(self, messages: Sequence[Message]) -> None:
        if self.archiver is not None:  # the deletion log itself, for the dataset job (never rewritten)
            await self.archive_retrier.call("archive deletions", asyncio.to_thread, self.archiver.write,
                                            [archived_message(m) for m in messages])

    async def carry_out(self, deletion: Deletion, m: Any, outbox: Outbox) -> None:
        self.erasures.add(deletion)  # first: whatever this worker writes after this is checked against it
        if self.cache is not None:
            entries = await self.retrier.call("response cache erase", self.cache.erase_user, deletion.tenant,
                                              deletion.user_id)
            self.cache_entries_erased += entries
            await self._audit(deletion, m, outbox, CACHE_COMPONENT, deletion.conversation_id, 0, entries)
            log.info("erased %d response-cache entr%s of %s/%s (deletion %s)", entries, "y" if entries == 1 else "ies",
                     deletion.tenant, deletion.user_id, deletion.event_id)
        if self.models is not None:
            await self._taint_models(deletion, m, outbox)
        for partition in range(self.partitions):
            await outbox.send(self.fanout_topic, key=m.key, value=m.value, headers=child_headers(m),
                              partition=partition)
        self.fanned_out += 1


    async def _taint_models(self, deletion: Deletion, m: Any, outbox: Outbox) -> None:
        """The model versions trained on the subject's erased rows, marked TAINTED (model_taint.py), audited."""
        versions = await self.retrier.call("model registry taint", asyncio.to_thread, self.models.tainted, deletion)
        for version in versions:
            await outbox.send(self.models_topic, key=model_key(version.name, version.version).encode(),
                              value=self.services.codec.encode(version), headers=child_headers(m))
            log.warning("model %s@%d tainted: %s", version.name, version.version, version.state_reason)
        self.versions_tainted += len(versions)
        await self._audit(deletion, m, outbox, MODELS_COMPONENT, deletion.conversation_id, 0, len(versions))


class ForgetPartition(_DeletionAgent):
    """One copy of a Deletion on partition ``p`` of the fan-out topic: memory, the table's partition ``p``
    and the archive files of partition ``p`` erased, each audited. A record put there by anything but
    ``Forget`` is checked and refused the same way."""

    def __init__(self, services: StreamsServices, table: Any, partitions: int, audit_topic: Any,
                 dead_letters: DeadLetters, retrier: Retrier, *, archiver: Archiver | None = None,
                 archive_topics: Sequence[str] = (), archive_retrier: Retrier | None = None,
                 erasures: ErasureRegistry | None = None) -> None:
        # archiver None: nothing to rewrite
        super().__init__(services, partitions, dead_letters, retrier, archiver, archive_retrier, erasures)
        self.table = table
        self.audit_topic = audit_topic
        self.archive_topics = tuple(archive_topics)  # real names (with the prefix) of the rewritten topics
        self.carried_out = 0

    async def carry_out(self, deletion: Deletion, m: Any, outbox: Outbox) -> None:
        partition = m.partition
        conversation = deletion.conversation_id if deletion.scope == DeletionScope.CONVERSATION else None
        self.erasures.add(deletion)  # first: whatever is written after this is checked against it
        # Not under the state lock: a slow Qdrant must not stop intake and record. Nothing can write the
        # subject's points back after this: the memory writer checks the registry again after each upsert
        # and deletes what it wrote for a subject erased meanwhile (memory_writer.py).
        points = await self.retrier.call(
            "memory forget", self.services.in_memory_thread, self.services.memory.forget,
            tenant=deletion.tenant, user_id=deletion.user_id, conversation_id=conversation)
        # The table: the keys of the partition this worker holds (streams/table.py) that the deletion
        # covers, under the lock a chunk at a time (no agent writes a forgotten conversation back: record
        # writes only a state still in the table), so a table of a million conversations holds intake and
        # record up for one chunk's scan at a time, not the whole table's.
        keys, table = [], self.table
        every = list(table.keys())
        for start in range(0, len(every), SCAN_CHUNK):
            async with self.services.state_lock:
                for key in every[start:start + SCAN_CHUNK]:
                    if key_partition(key, self.partitions) == partition and (value := table.get(key)) is not None \
                            and matches(value, deletion):
                        del table[key]
                        keys.append(key)
            await asyncio.sleep(0)  # intake and record take the lock between chunks
        await self._audit(deletion, m, outbox, COMPONENT, conversation, points, len(keys))
        log.info("forgot %s %s/%s%s on partition %d: %d memory points, %d conversations (deletion %s)",
                 deletion.scope, deletion.tenant, deletion.user_id, f"/{conversation}" if conversation else "",
                 partition, points, len(keys), deletion.event_id)
        if self.archiver is not None:
            await self._erase_archive(deletion, m, outbox)
        self.carried_out += 1

    async def _erase_archive(self, deletion: Deletion, message: Any, outbox: Outbox) -> None:
        subject = Subject.of(deletion)
        # fsyncs and deflate off the event loop; the archive agent's writes wait on the same lock
        erased = await self.archive_retrier.call("archive erase", asyncio.to_thread, self.archiver.erase,
                                                 self.archive_topics, subject, deletion.created_at,
                                                 {message.partition})
        await self._audit(deletion, message, outbox, ARCHIVE_COMPONENT, subject.conversation_id, 0,
                          len(erased.conversations))
        log.info("erased %s/%s%s from the archive's partition %d: %d record(s) of %d conversation(s) removed, "
                 "%d of %d file(s) rewritten in %.3f s (deletion %s)", deletion.tenant, deletion.user_id,
                 f"/{subject.conversation_id}" if subject.conversation_id else "", message.partition,
                 erased.records_removed, len(erased.conversations), erased.files_rewritten, erased.files_scanned,
                 erased.seconds, deletion.event_id)
