"""Who was erased, and as of when: the registry the record and archive agents check.

A ``Deletion`` erases what a user (or one conversation of theirs) produced **at or before** its
``created_at``. The forget agent removes what is stored by then (memory, table, archive), but
records made before the deletion can still arrive after it: a response in flight while the user
was forgotten, turns and feedback the archive had not read yet (archive lag). The record agent
asks ``erased`` before remembering a turn, the archive agent before archiving a turn or a
feedback, and drops what falls under a deletion.

The registry is rebuilt at start from ``chat.deletions`` itself (``load``: the topic is kept
forever and never compacted, it is the source of truth), then kept current by the forget agents
(``add``), which register a deletion *before* they erase the stores, so anything written after
the erasure is checked against it, and by ``ErasureFollower``, which hears every deletion on any
partition (with several streams workers each carries out only its partitions' share). One entry per (tenant, user) and per (tenant, user,
conversation), the newest deletion's time: small, and a start reads one record per deletion ever
made (``load`` says how long it took).

Not here: carrying deletions out (``forget.py``), rewriting the archive (``archive_erasure.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from schemas.codec import AvroCodec
from schemas.records import Deletion, DeletionScope
from transport.deletion_log import read_deletions
from schemas.topics import DELETIONS
from transport.broadcast import BroadcastListener
from transport.settings import IDLE_FETCH_WAIT_MS

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Subject:
    """What one deletion erases: a user of a tenant, or one conversation of theirs."""

    tenant: str
    user_id: str
    conversation_id: str | None  # None: every conversation of the user

    @classmethod
    def of(cls, deletion: Deletion) -> "Subject":
        scoped = deletion.scope == DeletionScope.CONVERSATION
        return cls(deletion.tenant, deletion.user_id, deletion.conversation_id if scoped else None)

    def covers(self, tenant: str, user_id: str, conversation_id: str | None) -> bool:
        return (tenant == self.tenant and user_id == self.user_id
                and (self.conversation_id is None or conversation_id == self.conversation_id))


class ErasureRegistry:
    """Newest deletion time per erased user and per erased conversation (epoch ms)."""

    def __init__(self) -> None:
        # Plain dicts: written on the event loop, read from the archive's writer thread; a dict's
        # get/set is atomic, and the forget agent adds before it rewrites (see the module docstring).
        self._users: dict[tuple[str, str], int] = {}
        self._conversations: dict[tuple[str, str, str], int] = {}

    def __len__(self) -> int:
        return len(self._users) + len(self._conversations)

    def add(self, deletion: Deletion) -> None:
        if deletion.scope != DeletionScope.CONVERSATION:
            _keep_newest(self._users, (deletion.tenant, deletion.user_id), deletion.created_at)
        elif deletion.conversation_id:  # without one: invalid, dead-lettered by the forget agent, erases nothing
            _keep_newest(self._conversations, (deletion.tenant, deletion.user_id, deletion.conversation_id),
                         deletion.created_at)

    def merge(self, other: "ErasureRegistry") -> None:
        """Take every entry of ``other`` (the newer time of each subject wins)."""
        for mine, theirs in ((self._users, other._users), (self._conversations, other._conversations)):
            for key, at in list(theirs.items()):
                _keep_newest(mine, key, at)

    def erased(self, tenant: str, user_id: str, conversation_id: str | None, created_at: int) -> bool:
        """Whether a record of this user (and conversation) created at ``created_at`` is erased."""
        until = self._users.get((tenant, user_id))
        if until is not None and created_at <= until:
            return True
        if conversation_id is None:
            return False
        until = self._conversations.get((tenant, user_id, conversation_id))
        return until is not None and created_at <= until

    def erases_record(self, record: Any) -> bool:
        """``erased`` for a decoded ``ConversationTurn`` or ``Feedback`` (any record with tenant,
        user_id, conversation_id and created_at); False for anything else, e.g. a ``Deletion``."""
        if isinstance(record, Deletion):
            return False
        try:
            tenant, user, conversation, created = (record.tenant, record.user_id, record.conversation_id,
                                                   record.created_at)
        except AttributeError:
            return False
        return self.erased(tenant, user, conversation, created)

    @classmethod
    def load(cls, kafka: Any, codec: AvroCodec | None = None, timeout_s: float = 30.0) -> "ErasureRegistry":
        """Every deletion on ``chat.deletions`` (read from its start to its end now)."""
        registry = cls()
        started = time.monotonic()
        deletions = read_deletions(kafka, codec, timeout_s=timeout_s)
        for deletion in deletions:
            registry.add(deletion)
        log.info("erasure registry: %d deletion(s) read from %s, %d subjects, in %.2f s",
                 len(deletions), kafka.topic(DELETIONS), len(registry), time.monotonic() - started)
        return registry


def _keep_newest(times: dict[Any, int], subject: tuple, at: int) -> None:
    """``times[subject]``: the newest deletion time of the subject (one dict write: atomic)."""
    times[subject] = max(at, times.get(subject, at))


class ErasureFollower(BroadcastListener):
    """Keeps a registry current with every deletion made on ``chat.deletions`` after it was loaded.

    Each streams worker carries out only the deletions of the partitions it owns (``forget.py``); the
    registry must still know every deletion, since a partition taken over after a rebalance may hold
    records in flight of a user another worker forgot. The broadcast listener's thread tails every
    partition (from the end, no group) and hands each Deletion to ``registry.add`` in that thread
    (``start(None, ...)``: the registry's dict writes are atomic; see ``ErasureRegistry``). Started
    **before** ``ErasureRegistry.load`` reads the log to its end, so no deletion falls between the two.
    If the thread fails, ``on_failure`` is called (the app exits with code 75: a worker that no longer
    hears deletions must not go on archiving).
    """

    topic, record_type, thread_name, fetch_wait_ms = DELETIONS, Deletion, "chatpipe-erasures", IDLE_FETCH_WAIT_MS
