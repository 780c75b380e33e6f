"""Erasure reaches models: a version trained on rows of an erased user is marked TAINTED.

A version's ``lineage.parquet`` (schemas/models.py) holds, per training example, the subject and
conversation hashes of the user it came from and ``oldest_at``, the time of its oldest record. A
``Deletion`` erases what was made at or before its ``created_at``; a version with a row of the deletion's
subject (and conversation, for a conversation's deletion) at or before that time learned from erased data.
The weights cannot forget one user's rows, so the version is marked: the same ``ModelVersion`` again on
``chat.models`` with state TAINTED and the deletion in ``state_reason`` (serving stops using it: the next
issue's rollout reads the state), and ``chatpipe train lora --rebuild NAME@VERSION`` trains its successor
without those rows. The forget agent calls :meth:`ModelTaint.tainted` once per deletion and audits the
result (component ``streams.models``), as it does for the response cache.

The registry is read whole for each deletion (deletions are rare; a registry holds a few records per
version), and each version's lineage is read with a filter on the subject, two columns at a time.
A version already TAINTED is left as it is, so a deletion carried out twice (a restart) taints nothing twice.
A lineage file that is gone or not Parquet taints its version (it cannot be cleared); any other error reading
it (the store away) is retried by the forget agent's retrier like a broker fault.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from schemas.records import Deletion, DeletionScope, ModelState, ModelVersion, new_id, now_ms
from schemas.subjects import conversation_key, subject_key

log = logging.getLogger(__name__)
COMPONENT = "streams.models"


def lineage_rows(uri: str, columns: list[str], subject: str | None = None, request_id: str | None = None):
    """The rows of a version's lineage file (fsspec URI or path) as a pyarrow Table, filtered by subject
    or by a request id among the row's ``request_ids``."""
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    # No Arrow thread pool at all: with Arrow's decoding pool started, `chatpipe model lineage` aborted at exit
    # in 2 of 8 runs ("terminate called without an active exception", SIGABRT); 0 of 12 without it, and again
    # once in a fresh-clone run where the filter used pyarrow.compute (its CPU pool). The files are small:
    # read without threads, filter in Python.
    with fsspec.open(uri, "rb") as f:
        table = pq.read_table(f, columns=sorted(set(columns) | {"subject", "request_ids"}), use_threads=False)
    rows = table.to_pylist()
    if subject is not None:
        rows = [r for r in rows if r["subject"] == subject]
    if request_id is not None:
        rows = [r for r in rows if request_id in (r["request_ids"] or ())]
    return pa.Table.from_pylist([{c: r[c] for c in columns} for r in rows], schema=table.select(columns).schema)


def erased_rows(version: ModelVersion, deletion: Deletion) -> int:
    """How many of the version's training rows hold records the deletion erases."""
    conversation = deletion.conversation_id if deletion.scope == DeletionScope.CONVERSATION else None
    return subject_rows(version, deletion.tenant, deletion.user_id, conversation, deletion.created_at)[0]


def subject_rows(version: ModelVersion, tenant: str, user_id: str, conversation_id: str | None,
                 until_ms: int) -> tuple[int, int]:
    """The version's training rows of a user (or of one of their conversations): (rows whose oldest record was
    made at or before ``until_ms``, rows made after it). A row without ``oldest_at`` counts as at or before."""
    conversation = conversation_key(tenant, user_id, conversation_id) if conversation_id is not None else None
    rows = lineage_rows(version.lineage_uri, ["conversation_key", "oldest_at"], subject=subject_key(tenant, user_id))
    before = after = 0
    for conv, oldest in zip(rows.column("conversation_key").to_pylist(), rows.column("oldest_at").to_pylist()):
        if conversation is not None and conv != conversation:
            continue
        if oldest is None or oldest <= until_ms:
            before += 1
        else:
            after += 1
    return before, after


class ModelTaint:
    """Which versions a deletion taints (read from the registry on the broker)."""

    def __init__(self, kafka: Any) -> None:
        self.kafka = kafka

    def tainted(self, deletion: Deletion) -> list[ModelVersion]:
        """The TAINTED records to write for ``deletion`` (blocking: the registry and lineage files are read)."""
        import pyarrow as pa

        from transport.model_registry import read_model_versions

        out = []
        for version in read_model_versions(self.kafka).values():
            if version.state == ModelState.TAINTED or deletion.tenant not in version.data_tenants:
                continue
            try:
                rows = erased_rows(version, deletion)
                why = f"{rows} training row(s) of an erased " + (
                    "conversation" if deletion.scope == DeletionScope.CONVERSATION else "user")
            except (FileNotFoundError, pa.ArrowInvalid) as exc:
                # The version's fault, not the infrastructure's (retrying would stop the forget agent for good):
                # whose rows it learned from cannot be told, so it is tainted rather than kept.
                rows, why = 1, f"its lineage {version.lineage_uri} is gone or unreadable ({exc}), so it cannot be cleared"
                log.warning("%s@%d: lineage %s unreadable (%s): tainted", version.name, version.version,
                            version.lineage_uri, exc)
            if rows:
                out.append(dataclasses.replace(
                    version, event_id=new_id(), state=ModelState.TAINTED, updated_at=now_ms(),
                    state_reason=f"deletion {deletion.event_id}: {why}; rebuild with `chatpipe train lora --rebuild {version.name}@{version.version}`"))
        return out
