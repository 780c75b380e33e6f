"""``chatpipe forget --verify``: search every store for a user's data and say what remains.

The subject is a tenant's user (or one conversation of theirs). Its newest covering ``Deletion``
on ``chat.deletions`` sets the line: what was made **at or before** it must be gone from the
stores a deletion erases, what was made after it is the user's new data and only counted
("newer"). Without any deletion everything found counts as remaining (a look before erasing).

Per store, read-only, while the pipeline runs:

- **memory**: a Qdrant server is asked to count (filter tenant, user, conversation, created_at);
  in local mode the one SQLite file of the user's partition is read directly, read-only: local
  mode holds an exclusive lock on its folder (``.lock``) for the streams process, but SQLite
  itself lets a reader in beside the writer (write-ahead log), so no copy and no stop is needed.
- **state**: the conversation table's changelog, latest value per key; a conversation of the
  subject with a recent turn or a pending request made by the deletion remains. Superseded
  values still in the log until compaction are counted under topics.
- **archive**: every Avro file of ``chat.turns`` and ``chat.feedback`` under the archive folder.
- **datasets**: ``spark_jobs.erasure.affected_datasets``; a dataset built before the deletion is
  *affected* (listed, expected: it predates the erasure), one built after it holding the subject
  is a failure (the job must have excluded it).
- **topics**: the request, response, turn, feedback and dead-letter topics, the subject's
  records on each and when retention removes the oldest (reported, not a failure: documented in
  docs/privacy.md).
- **response cache**: the Redis of streams' response cache (``--cache-url`` / ``CHATPIPE_CACHE_URL``),
  every entry of the tenant read (SCAN, not the user's index: what is there is what counts); an entry
  the subject owns made by the deletion remains. No URL: not checked.
- **models**: the versions on ``chat.models`` whose lineage holds the subject's rows; one trained on rows made
  by the deletion must be TAINTED (then *affected*: listed, rebuild it).
- **audits**: ``chat.deletions.audit`` for the subject's deletions: which stores acknowledged.

``failed`` is true when something remains that should not: memory, state or archive hold data
of the subject made by the deletion, a dataset built after it holds the subject, a model version trained on
the subject's rows made by the deletion is not tainted, or the newest
deletion has no acknowledgement of ``streams.forget`` / ``streams.archive`` yet.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from schemas.codec import AvroCodec, default_codec
from schemas.errors import DecodeError
from schemas.records import Deletion, DeletionAudit, DeletionScope, ModelState
from schemas.topics import (
    DELETIONS_AUDIT,
    DLQ,
    FEEDBACK,
    INFERENCE_REQUESTS,
    INFERENCE_REQUESTS_BATCH,
    MODELS,
    PROMPTS,
    RESPONSES,
    TURNS,
    spec,
)
from streams.archive_erasure import archive_files, may_hold, subject_record
from streams.erasures import Subject
from transport.deletion_log import read_deletions
from transport.topic_scan import read_to_end
from transport.archive import read_messages

Progress = Callable[[str], None]
#: Topics a subject's copies sit on until retention removes them (the gateways' reply topics carry
#: answer text without a user id: removed by their own retention, see docs/privacy.md).
COPY_TOPICS = (PROMPTS, INFERENCE_REQUESTS, INFERENCE_REQUESTS_BATCH, RESPONSES, TURNS, FEEDBACK, DLQ)
REQUIRED_AUDITS = ("streams.forget", "streams.archive")
PARTITIONS = spec(PROMPTS).partitions  # the forget fan-out's: one audit of each per partition
NO_LINE = 2**63 - 1  # no deletion: everything found counts as remaining


@dataclass(slots=True)
class StoreReport:
    store: str
    remaining: int = 0  # the subject's items made at or before the deletion still there
    newer: int = 0  # made after the deletion: not erased by it
    affected: int = 0  # datasets built before the deletion that hold the subject (listed, expected)
    must_be_empty: bool = True
    checked: bool = True
    details: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.checked and self.must_be_empty and self.remaining > 0


@dataclass(slots=True)
class VerifyReport:
    subject: Subject
    deletions: list[Deletion]
    until_ms: int | None  # created_at of the newest covering deletion
    stores: list[StoreReport]

    @property
    def failed(self) -> bool:
        return any(s.failed for s in self.stores)


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _covers(deletion: Deletion, subject: Subject) -> bool:
    if (deletion.tenant, deletion.user_id) != (subject.tenant, subject.user_id):
        return False
    if deletion.scope == DeletionScope.USER:
        return True
    return subject.conversation_id is not None and deletion.conversation_id == subject.conversation_id


# -- the deletion log and its audits --------------------------------------------------------------

def subject_deletions(kafka: Any, subject: Subject, codec: AvroCodec) -> list[Deletion]:
    """Every deletion of the subject's user on ``chat.deletions``, oldest first."""
    return sorted((d for d in read_deletions(kafka, codec) if (d.tenant, d.user_id) == (subject.tenant, subject.user_id)),
                  key=lambda d: d.created_at)


def _decoded(message: Any, record_type: type, codec: AvroCodec) -> Any:
    """The ``record_type`` a message holds; None for a tombstone or bytes that do not decode."""
    if message.value() is None:
        return None
    try:
        return codec.decode(message.value(), record_type)
    except DecodeError:
        return None


def check_audits(kafka: Any, deletions: list[Deletion], newest: Deletion | None, codec: AvroCodec) -> StoreReport:
    report = StoreReport("audits")
    wanted = {d.event_id: d for d in deletions}
    # component -> partitions that acknowledged (streams audits once per conversation partition)
    components: dict[str, Counter] = {event_id: Counter() for event_id in wanted}

    def take(message: Any) -> None:
        audit = _decoded(message, DeletionAudit, codec)
        if audit is not None and audit.deletion_event_id in components:
            components[audit.deletion_event_id][audit.component] += 1

    read_to_end(kafka, kafka.topic(DELETIONS_AUDIT), take)
    for event_id, deletion in wanted.items():
        got = [c if c not in REQUIRED_AUDITS else f"{c} ({n}/{PARTITIONS} partitions)"
               for c, n in sorted(components[event_id].items())]
        scope = deletion.conversation_id if deletion.scope == DeletionScope.CONVERSATION else "whole user"
        report.details.append(f"deletion {event_id} ({scope}, {_when(deletion.created_at)}): acknowledged by "
                              f"{', '.join(got) or 'nobody yet'}")
    if newest is not None:
        # a repeat after a restart may add more; fewer than one per partition is not done yet
        missing = [c for c in REQUIRED_AUDITS if components[newest.event_id][c] < PARTITIONS]
        report.remaining = len(missing)
        if missing:
            report.details.append(f"the newest deletion is not acknowledged by {', '.join(missing)} yet "
                                  "(is `chatpipe streams` running?)")
        if not any(c.startswith("inference.worker:") for c in components[newest.event_id]):
            report.details.append("no inference worker acknowledged the newest deletion (prefix cache); workers "
                                  "started after it begin with an empty cache")
    return report


# -- response cache -------------------------------------------------------------------------------

def check_cache(cache: Any, subject: Subject, until_ms: int) -> StoreReport:
    """``cache``: the streams worker's ``CacheSettings`` (``url`` None: no response cache, not checked)."""
    if not cache.url:
        return StoreReport("cache", checked=False, details=["no response cache URL (--cache-url / CHATPIPE_CACHE_URL)"])
    from streams.response_cache import CacheServer

    # a scan of the tenant's entries: give each call more than the serving path's 100 ms
    server = CacheServer(cache.model_copy(update={"timeout_s": max(cache.timeout_s, 10.0)}))
    try:
        entries = [e for e in server.entries_of(subject.tenant, subject.user_id)
                   if subject.conversation_id is None or e.conversation_id == subject.conversation_id]
    finally:
        server.close()
    remaining = sum(1 for e in entries if e.created_at <= until_ms)
    return StoreReport("cache", remaining, len(entries) - remaining, details=[f"Redis {_redacted(cache.url)}"])


def _redacted(url: str) -> str:
    """``url`` without a password."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}" if "@" in rest else url


# -- memory ---------------------------------------------------------------------------------------

def check_memory(memory: Any, subject: Subject, until_ms: int) -> StoreReport:
    """``memory``: the ``MemorySettings`` of the streams worker."""
    if memory.url:
        return StoreReport("memory", *_server_counts(memory, subject, until_ms),
                           details=[f"Qdrant server {memory.url}, collection {memory.collection}"])
    remaining, newer, where = _local_counts(memory, subject, until_ms)
    return StoreReport("memory", remaining, newer, details=[f"local mode, read-only from {where}"])


def _server_counts(memory: Any, subject: Subject, until_ms: int) -> tuple[int, int]:
    from qdrant_client import QdrantClient, models

    api_key = memory.api_key.get_secret_value() if memory.api_key else None
    with closing(QdrantClient(url=memory.url.split(",")[0].strip(), api_key=api_key, timeout=memory.timeout_s,
                              check_compatibility=False)) as client:
        must = [models.FieldCondition(key="tenant", match=models.MatchValue(value=subject.tenant)),
                models.FieldCondition(key="user_id", match=models.MatchValue(value=subject.user_id))]
        if subject.conversation_id is not None:
            must.append(models.FieldCondition(key="conversation_id",
                                              match=models.MatchValue(value=subject.conversation_id)))
        if not client.collection_exists(memory.collection):
            return 0, 0
        count = lambda rng: client.count(memory.collection, exact=True, count_filter=models.Filter(
            must=[*must, models.FieldCondition(key="created_at", range=rng)])).count
        return count(models.Range(lte=until_ms)), count(models.Range(gt=until_ms))


def _local_counts(memory: Any, subject: Subject, until_ms: int) -> tuple[int, int, str]:
    import pickle

    from streams.memory_local import partition_of

    name = partition_of(memory.collection, memory.local_partitions, subject.tenant, subject.user_id)
    db = Path(memory.path) / "collection" / name / "storage.sqlite"
    if not db.exists():
        return 0, 0, str(db)
    remaining = newer = 0
    # read-only, beside the streams process's writes
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as connection:
        for (blob,) in connection.execute("SELECT point FROM points"):
            payload = getattr(pickle.loads(blob), "payload", None) or {}
            if not subject.covers(payload.get("tenant"), payload.get("user_id"), payload.get("conversation_id")):
                continue
            if int(payload.get("created_at", 0)) <= until_ms:
                remaining += 1
            else:
                newer += 1
    return remaining, newer, str(db)


# -- conversation state ---------------------------------------------------------------------------

def check_state(kafka: Any, changelog: str, subject: Subject, until_ms: int,
                progress: Progress | None = None) -> tuple[StoreReport, int]:
    """The table's latest values; also returns how many superseded values of the subject the
    changelog still holds (gone when compaction runs)."""
    report = StoreReport("state")
    latest: dict[str, dict | None] = {}
    superseded = 0

    def ours(value: dict | None) -> bool:
        return bool(value) and subject.covers(value.get("tenant"), value.get("user_id"), value.get("conversation_id"))

    def take(message: Any) -> None:
        nonlocal superseded
        key = message.key().decode("utf-8", "replace") if message.key() else ""
        value = json.loads(message.value()) if message.value() is not None else None
        if ours(latest.get(key)):
            superseded += 1
        latest[key] = value

    read_to_end(kafka, changelog, take, progress=_counting(progress, changelog))
    for key, value in latest.items():
        if not ours(value):
            continue
        times = [t["created_at"] for t in value.get("recent", [])] + [p["created_at"] for p in value.get("pending", [])]
        old = [t for t in times if t <= until_ms]
        if old:
            report.remaining += 1
            report.details.append(f"conversation {value.get('conversation_id')}: {len(old)} turn(s)/request(s) "
                                  "made by the deletion")
        else:
            report.newer += 1
    report.details.insert(0, f"changelog {changelog}: {len(latest)} keys")
    return report, superseded


# -- archive --------------------------------------------------------------------------------------

def check_archive(archive_dir: Path | None, topics: list[str], subject: Subject, until_ms: int, codec: AvroCodec,
                  progress: Progress | None = None) -> StoreReport:
    if archive_dir is None or not Path(archive_dir).is_dir():
        return StoreReport("archive", checked=False, details=[f"no archive folder at {archive_dir} (give --archive-dir)"])
    report = StoreReport("archive")
    needle = subject.user_id.encode()
    files = [p for topic in topics for p in archive_files(archive_dir, topic)]
    for i, path in enumerate(files, 1):
        if progress is not None and i % 200 == 0:
            progress(f"archive: {i} of {len(files)} files scanned")
        hits = 0
        if not may_hold(path, needle):  # no block holds the user id's bytes: no record parsed
            continue
        for m in read_messages(path):
            if subject_record(m.value, subject, NO_LINE, codec, needle) is None:
                continue
            record = codec.decode(m.value)
            if record.created_at <= until_ms:
                report.remaining += 1
                hits += 1
            else:
                report.newer += 1
        if hits:
            report.details.append(f"{path}: {hits} record(s)")
    report.details.insert(0, f"{len(files)} files of {', '.join(topics)} under {archive_dir}")
    return report


# -- datasets -------------------------------------------------------------------------------------

def check_datasets(datasets_dir: Path | None, subject: Subject, until_ms: int) -> StoreReport:
    if datasets_dir is None:
        return StoreReport("datasets", checked=False, details=["not checked: give --datasets-dir (the folder the "
                                                               "dataset builds are written under)"])
    from spark_jobs.erasure import affected_datasets  # the dataset job's side of the contract (no pyspark)

    report = StoreReport("datasets")
    for found in affected_datasets(Path(datasets_dir), subject.tenant, subject.user_id, subject.conversation_id):
        if found.built_at_ms <= until_ms:
            report.affected += 1
            report.details.append(f"affected (built {_when(found.built_at_ms)}, before the deletion): {found.path}, "
                                  f"{found.rows} row(s); rebuild or delete it")
        else:
            report.remaining += 1
            report.details.append(f"built {_when(found.built_at_ms)}, AFTER the deletion, still holds the subject: "
                                  f"{found.path}, {found.rows} row(s)")
    return report


# -- model versions -------------------------------------------------------------------------------

def check_models(kafka: Any, subject: Subject, until_ms: int) -> StoreReport:
    """The versions on ``chat.models`` whose lineage holds the subject's rows. Weights cannot forget: a version
    trained on rows made by the deletion is *affected* once TAINTED (listed: rebuild it), and remains (a failure)
    while it is not; a version that learned only from newer rows is counted as newer."""
    import pyarrow as pa

    from streams.model_taint import subject_rows
    from transport.model_registry import read_model_versions

    report = StoreReport("models")
    for version in read_model_versions(kafka).values():
        if subject.tenant not in version.data_tenants:
            continue
        ref = f"{version.name}@{version.version}"
        try:
            before, after = subject_rows(version, subject.tenant, subject.user_id, subject.conversation_id, until_ms)
        except (FileNotFoundError, pa.ArrowInvalid) as exc:
            before, after = 1, 0  # who trained it cannot be told: as the forget agent, count it as holding the subject
            report.details.append(f"{ref}: lineage {version.lineage_uri} unreadable ({exc})")
        if before and version.state == ModelState.TAINTED:
            report.affected += 1
            report.details.append(f"{ref}: {before} row(s), TAINTED; `chatpipe train lora --rebuild {ref}` trains "
                                  "its successor without them")
        elif before:
            report.remaining += 1
            report.details.append(f"{ref}: {before} row(s) made by the deletion, state {version.state.value}, "
                                  "NOT tainted")
        elif after:
            report.newer += 1
            report.details.append(f"{ref}: {after} row(s) made after the deletion")
    return report


# -- topics ---------------------------------------------------------------------------------------

def check_topics(kafka: Any, subject: Subject, codec: AvroCodec, superseded_state: int, changelog: str,
                 progress: Progress | None = None) -> StoreReport:
    """Copies on the topics until retention: counted, with when the oldest goes; never a failure."""
    report = StoreReport("topics", must_be_empty=False)
    needle = subject.user_id.encode()
    for name in COPY_TOPICS:
        hits: list[int] = []  # Kafka timestamps (ms) of the subject's messages

        def take(message: Any) -> None:
            value = message.value()
            if value is not None and needle in value and _subject_message(value, subject, codec):
                hits.append(message.timestamp()[1])

        read_to_end(kafka, kafka.topic(name), take, progress=_counting(progress, name))
        retention = spec(name).retention_ms
        if hits:
            report.remaining += len(hits)
            gone = "never (kept forever)" if retention < 0 else f"by ~{_when(max(hits) + retention)} (retention " \
                   f"{retention / 86_400_000:g} d, plus up to the segment roll time)"
            report.details.append(f"{name}: {len(hits)} message(s), oldest {_when(min(hits))}; removed {gone}")
        else:
            report.details.append(f"{name}: none")
    if superseded_state:
        report.remaining += superseded_state
        report.details.append(f"{changelog}: {superseded_state} superseded value(s) of the subject, removed when "
                              "the log is compacted")
    return report


def _subject_message(value: bytes, subject: Subject, codec: AvroCodec) -> bool:
    try:
        record = codec.decode(value)
    except DecodeError:
        return False
    inner = getattr(record, "value", None)  # a DeadLetter carries the refused record's bytes
    if type(record).__name__ == "DeadLetter":
        return inner is not None and _subject_message(inner, subject, codec)
    try:
        return subject.covers(record.tenant, record.user_id, getattr(record, "conversation_id", None))
    except AttributeError:
        return False


def _counting(progress: Progress | None, what: str) -> Callable[[int], None] | None:
    if progress is None:
        return None
    return lambda n: progress(f"{what}: {n} messages read")


# -- all together ---------------------------------------------------------------------------------

def verify(kafka: Any, subject: Subject, *, memory: Any, archive_dir: Path | None, datasets_dir: Path | None,
           changelog: str, codec: AvroCodec | None = None, progress: Progress | None = None,
           cache: Any = None) -> VerifyReport:
    codec = codec or default_codec()
    say = progress or (lambda _: None)
    say("reading chat.deletions")
    deletions = subject_deletions(kafka, subject, codec)
    covering = [d for d in deletions if _covers(d, subject)]
    newest = covering[-1] if covering else None
    until = newest.created_at if newest is not None else NO_LINE
    stores: list[StoreReport] = []
    say("memory")
    stores.append(check_memory(memory, subject, until))
    say("conversation state (changelog)")
    state, superseded = check_state(kafka, changelog, subject, until, progress)
    stores.append(state)
    say("archive")
    stores.append(check_archive(archive_dir, [kafka.topic(TURNS), kafka.topic(FEEDBACK)], subject,
                                until, codec, progress))
    say("datasets")
    stores.append(check_datasets(datasets_dir, subject, until))
    say(kafka.topic(MODELS))
    stores.append(check_models(kafka, subject, until))
    if cache is not None:
        say("response cache")
        stores.append(check_cache(cache, subject, until))
    say("topics")
    stores.append(check_topics(kafka, subject, codec, superseded, changelog, progress))
    say(kafka.topic(DELETIONS_AUDIT))
    stores.append(check_audits(kafka, deletions, newest, codec))
    return VerifyReport(subject, deletions, newest.created_at if newest else None, stores)
