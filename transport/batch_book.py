"""The Batch API's state on Kafka: ``BatchJob`` records on the compacted ``chat.batches`` and each line's
answer (``BatchLineResult``) on the compacted ``chat.batch.results``, a batch's records in one partition
of each (``schemas.topics.batch_partition``).

Several writers touch one batch: the gateway that makes it, any gateway a client asks to cancel it, the
gateway whose runner runs it (progress, then the end). Each writes the whole record, so two written at
once could undo each other (a progress report written from a copy made before a cancel). ``merge`` is
how every reader combines what it reads, in order: the time of each step a batch took is kept once any
record had it (a cancel is never forgotten), counts only grow, file ids stay, and the status follows
from the steps taken. A writer publishes ``merge(what it read, its change)``, so the latest record alone
(what compaction keeps) holds every step. ``BatchBook`` is that view, kept current from the topic by
every gateway (``GET /v1/batches``) and read once by ``chatpipe batch``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable

from schemas.codec import AvroCodec, default_codec
from schemas.errors import ChatpipeError, DecodeError
from schemas.records import BatchJob, BatchLineResult, BatchStatus, now_ms
from schemas.topics import BATCH_RESULTS, BATCHES, batch_partition
from transport.followed_records import FollowedRecords
from transport.settings import KafkaSettings
from transport.topic_scan import read_to_end

#: The steps a batch may take, each with the time it was taken; the first set in this order is its status.
STEPS = (("failed_at", BatchStatus.FAILED), ("cancelled_at", BatchStatus.CANCELLED),
         ("expired_at", BatchStatus.EXPIRED), ("completed_at", BatchStatus.COMPLETED),
         ("cancelling_at", BatchStatus.CANCELLING), ("finalizing_at", BatchStatus.FINALIZING),
         ("in_progress_at", BatchStatus.IN_PROGRESS))
ENDED = {BatchStatus.FAILED, BatchStatus.CANCELLED, BatchStatus.EXPIRED, BatchStatus.COMPLETED}
_COUNTS = ("total", "completed", "failed", "input_tokens", "output_tokens", "cached_tokens")
_KEPT = ("output_file_id", "error_file_id", "expires_at")


class BatchStoreError(ChatpipeError):
    """A batch record or line result the broker did not take."""


def status_of(job: BatchJob) -> BatchStatus:
    for step, status in STEPS:
        if getattr(job, step) is not None:
            return status
    return BatchStatus.VALIDATING


def merge(old: BatchJob | None, new: BatchJob) -> BatchJob:
    """``new`` read after ``old`` (same batch): steps and file ids kept once set, counts never lower."""
    if old is None:
        return replace(new, status=status_of(new))
    kept = {step: getattr(new, step) or getattr(old, step) for step, _ in STEPS}
    kept |= {name: max(getattr(old, name), getattr(new, name)) for name in _COUNTS}
    kept |= {name: getattr(new, name) or getattr(old, name) for name in _KEPT}
    merged = replace(new, errors=new.errors or old.errors, updated_at=max(old.updated_at, new.updated_at), **kept)
    return replace(merged, status=status_of(merged))


def result_key(batch_id: str, custom_id: str) -> bytes:
    return f"{batch_id}/{custom_id}".encode()


class BatchBook(FollowedRecords):
    """Every batch's merged state (``merge``), from ``chat.batches``."""

    def __init__(self, kafka: KafkaSettings, codec: AvroCodec | None = None) -> None:
        super().__init__(kafka, BATCHES, BatchJob, lambda job: job.batch_id, merge, codec)

    def get(self, batch_id: str, tenant: str | None = None) -> BatchJob | None:
        job = self.record(batch_id)
        return job if job is not None and (tenant is None or job.tenant == tenant) else None

    def wait_for(self, batch_id: str, tenant: str, timeout_s: float) -> BatchJob | None:
        job = self.wait_record(batch_id, timeout_s)
        return job if job is not None and job.tenant == tenant else None

    def jobs(self, tenant: str | None = None) -> list[BatchJob]:
        """Newest first."""
        found = [j for j in self.records() if tenant is None or j.tenant == tenant]
        return sorted(found, key=lambda j: (j.created_at, j.batch_id), reverse=True)


class BatchWriter:
    """Writes batch records and line results, each waited for (acks=all): a batch says "completed" only
    once what it says is on the broker."""

    def __init__(self, kafka: KafkaSettings, codec: AvroCodec | None = None, timeout_s: float = 30.0) -> None:
        from transport import clients

        self.kafka, self.codec, self.timeout_s = kafka, codec or default_codec(), timeout_s
        self.partitions = _partitions(kafka)
        self._producer = clients.producer(kafka, {"acks": "all", "enable.idempotence": True, "linger.ms": 5,
                                                  "message.timeout.ms": int(timeout_s * 1000)})

    def publish(self, job: BatchJob) -> None:
        self._send([(BATCHES, job.batch_id.encode(), self.codec.encode(replace(job, updated_at=now_ms())),
                     job.batch_id)])

    def results(self, results: Iterable[BatchLineResult]) -> None:
        self._send([(BATCH_RESULTS, result_key(r.batch_id, r.custom_id), self.codec.encode(r), r.batch_id)
                    for r in results])

    def forget_results(self, batch_id: str, custom_ids: Iterable[str]) -> None:
        """Tombstones for a batch's results once its files are written (compaction then drops them)."""
        self._send([(BATCH_RESULTS, result_key(batch_id, c), None, batch_id) for c in custom_ids])

    def _send(self, records: list[tuple[str, bytes, bytes | None, str]]) -> None:
        errors: list = []
        for topic, key, value, batch_id in records:
            self._producer.produce(self.kafka.topic(topic), value, key,
                                   partition=batch_partition(batch_id, self.partitions[topic]),
                                   on_delivery=lambda err, _m: err is not None and errors.append(err))
            self._producer.poll(0)
        left = self._producer.flush(self.timeout_s)
        if errors or left:
            raise BatchStoreError(f"the broker did not take {len(errors) or left} batch record(s): "
                                  f"{errors[0] if errors else 'not acknowledged in time'}")

    def close(self) -> None:
        self._producer.flush(self.timeout_s)


def _partitions(kafka: KafkaSettings) -> dict[str, int]:
    """The partition counts of the two topics as the catalog gives them (``chatpipe topics apply`` makes them so)."""
    from schemas.topics import spec

    return {BATCHES: spec(BATCHES).partitions, BATCH_RESULTS: spec(BATCH_RESULTS).partitions}


def read_results(kafka: KafkaSettings, batch_id: str, codec: AvroCodec | None = None,
                 timeout_s: float = 60.0) -> dict[str, BatchLineResult]:
    """The stored answers of ``batch_id``'s lines, by custom id (the first stored of a line wins: a line
    run twice, by a runner that took over, has the same answer twice or a second one never shown)."""
    codec = codec or default_codec()
    prefix = f"{batch_id}/".encode()
    found: dict[str, BatchLineResult] = {}

    def take(message: Any) -> None:
        key = message.key() or b""
        if not key.startswith(prefix):
            return
        custom_id = key[len(prefix):].decode("utf-8", "replace")
        if message.value() is None:
            found.pop(custom_id, None)
        elif custom_id not in found:
            try:
                found[custom_id] = codec.decode(message.value(), BatchLineResult)
            except DecodeError:
                pass

    read_to_end(kafka, kafka.topic(BATCH_RESULTS), take, timeout_s=timeout_s,
                partitions=[batch_partition(batch_id, _partitions(kafka)[BATCH_RESULTS])])
    return found


__all__ = ["BatchBook", "BatchWriter", "BatchStoreError", "merge", "status_of", "read_results", "ENDED"]
