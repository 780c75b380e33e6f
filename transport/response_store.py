"""Stored responses of the Responses API on the compacted ``chat.api.responses`` (``StoredResponse``, key
``response_id``), as every gateway keeps them: any replica answers ``GET /v1/responses/{id}`` and continues
a chain (``previous_response_id``), after its own restart too, since the state is the topic's.

A response is written whole at each change (queued, in progress, its end, deleted); readers merge what
they read (``merge``): a deleted response stays deleted, a cancelled one cancelled, whatever a writer
that had not seen it yet writes after. An erasure deletes them too: every gateway reads the deletion log
at its start and follows it (``Deletion`` of a user: their responses; of a conversation: its chain's),
marking the matching responses deleted on the topic (each gateway writes the same marker: harmless).
"""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from typing import Any, Callable

from schemas.codec import AvroCodec, default_codec
from schemas.errors import ChatpipeError
from schemas.records import Deletion, DeletionScope, StoredResponse, now_ms
from schemas.topics import DELETIONS, STORED_RESPONSES
from transport import clients
from transport.broadcast import BroadcastListener
from transport.deletion_log import read_deletions
from transport.followed_records import FollowedRecords
from transport.settings import IDLE_FETCH_WAIT_MS, KafkaSettings

ENDED = ("completed", "incomplete", "failed", "cancelled")


class ResponseStoreError(ChatpipeError):
    """A stored response the broker did not take."""


def merge(old: StoredResponse | None, new: StoredResponse) -> StoredResponse:
    if old is None:
        return new
    if old.deleted:
        return old
    if old.status == "cancelled" and not new.deleted:
        return old
    return new


def erased_by(deletion: Deletion, stored: StoredResponse) -> bool:
    if (stored.tenant, stored.user_id) != (deletion.tenant, deletion.user_id):
        return False
    return deletion.scope is DeletionScope.USER or stored.conversation_id == deletion.conversation_id


class DeletionListener(BroadcastListener):
    topic, record_type, thread_name, fetch_wait_ms = DELETIONS, Deletion, "chatpipe-response-erasures", IDLE_FETCH_WAIT_MS


class ResponseStore:
    def __init__(self, kafka: KafkaSettings, codec: AvroCodec | None = None, timeout_s: float = 30.0) -> None:
        self.kafka, self.codec, self.timeout_s = kafka, codec or default_codec(), timeout_s
        self.view = FollowedRecords(kafka, STORED_RESPONSES, StoredResponse, lambda r: r.response_id, merge, self.codec)
        self._producer = None
        self._deletions: DeletionListener | None = None
        self._lock = threading.Lock()

    def start(self, on_failure: Callable[[BaseException], None]) -> None:
        """Follow the stored responses, then erase what the deletion log says and follow it (blocking)."""
        self._producer = clients.producer(self.kafka, {"acks": "all", "enable.idempotence": True, "linger.ms": 2,
                                                       "message.timeout.ms": int(self.timeout_s * 1000)})
        self.view.start(on_failure)
        self._deletions = DeletionListener(self.kafka, self.codec)
        self._deletions.start(None, self.erase, on_failure)
        self._deletions.ready.wait(10.0)
        for deletion in read_deletions(self.kafka, self.codec, self.timeout_s):
            self.erase(deletion)

    def close(self) -> None:
        self.view.close()
        if self._deletions is not None:
            self._deletions.close()
        if self._producer is not None:
            self._producer.flush(self.timeout_s)

    def publish(self, stored: StoredResponse) -> StoredResponse:
        """Write ``stored`` (acks=all: ResponseStoreError if the broker does not take it); returns the merged view."""
        current = self.view.record(stored.response_id)
        # what this gateway knows already stays (a cancel, a deletion): written so, the latest record alone holds
        # it, and compaction (which keeps only the latest) cannot bring back what was undone
        stored = replace(merge(current, stored) if current is not None else stored, updated_at=now_ms())
        errors: list = []
        with self._lock:
            self._producer.produce(self.kafka.topic(STORED_RESPONSES), self.codec.encode(stored),
                                   stored.response_id.encode(),
                                   on_delivery=lambda err, _m: err is not None and errors.append(err))
            left = self._producer.flush(self.timeout_s)
        if errors or left:
            raise ResponseStoreError(f"the broker did not take response {stored.response_id}: "
                                  f"{errors[0] if errors else 'not acknowledged in time'}")
        return self.view.apply(stored)

    def get(self, response_id: str, tenant: str, wait_s: float = 0.0) -> StoredResponse | None:
        """The tenant's stored response (None: none, another tenant's, or deleted); ``wait_s``: how long to
        wait for one another gateway has just stored."""
        stored = self.view.wait_record(response_id, wait_s) if wait_s else self.view.record(response_id)
        return stored if stored is not None and stored.tenant == tenant and not stored.deleted else None

    def chain(self, last: StoredResponse) -> list[StoredResponse]:
        """``last`` and the responses before it, oldest first (a deleted one ends the chain there)."""
        chain = [last]
        while chain[-1].previous_response_id:
            earlier = self.get(chain[-1].previous_response_id, last.tenant)
            if earlier is None:
                break
            chain.append(earlier)
        return chain[::-1]

    def delete(self, stored: StoredResponse) -> None:
        self.publish(replace(stored, deleted=True, messages="[]", body=json.dumps({"id": stored.response_id})))

    def erase(self, deletion: Deletion) -> None:
        for stored in self.view.records():
            if not stored.deleted and erased_by(deletion, stored):
                self.delete(stored)


def body_of(stored: StoredResponse) -> dict[str, Any]:
    return json.loads(stored.body)
