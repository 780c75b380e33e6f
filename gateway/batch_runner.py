"""Runs the batches of the Batch API: each gateway runs those of the ``chat.batches`` partitions its
runner's consumer group gives it, so a batch runs on one gateway at a time and moves to another when
that one goes (the group hands its partitions over).

A batch's lines run as ordinary requests to this gateway's own app (``asgi_call.post``, the key that made
the batch, ``service_tier`` flex: the batch priority class, which fills idle capacity and yields to
interactive traffic), at most ``batch_concurrency`` at once. Each answer is stored on
``chat.batch.results`` (acks=all) before it counts; a runner that takes a batch over reads what is stored
and runs only the other lines (``batch_book.read_results``), so a crash anywhere loses no line and
stores none twice (a line in flight at the crash runs again; the first stored answer is the one kept).

A line that gets 429 (the batch class is full: ``flex_max_wait_s``) or 503 (no worker, broker away)
waits and runs again, until the batch expires; a 5xx runs again up to ``LINE_ATTEMPTS`` times; any other
answer is the line's, an error line if it is one. A batch asked to cancel stops its lines (each one's
worker gets a ``Cancel``, as for a client that left) and ends ``cancelled``; one past its window ends
``expired``; either keeps the lines done. At the end the output file (2xx answers) and the error file
(the rest; ``batch_expired`` / ``batch_cancelled`` for lines never run) are written to the file store
under ids made from the batch id (a runner that ends a batch twice writes the same files), the batch
record says where, and the stored answers are tombstoned.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from gateway import asgi_call
from gateway.batch_lines import BatchLine, read_lines
from gateway.streaming import REQUEST_HEADER
from gateway.translate import MEMORY_HEADER
from schemas.records import BatchError, BatchJob, BatchLineResult, BatchStatus
from schemas.topics import BATCHES, batch_partition
from transport.batch_book import BatchBook, BatchWriter, read_results
from transport.file_store import FileStore, FileStoreError
from transport.settings import KafkaSettings
from transport.spans import INTERNAL

log = logging.getLogger(__name__)

LINE_ATTEMPTS = 3  # a line answered 5xx runs at most this often
RETRY_WAIT_S = (1.0, 30.0)  # bounds of the wait before a line runs again (a 429's Retry-After inside them)
ACTIVE = (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING, BatchStatus.FINALIZING)
_STOPPED = 499  # the route's answer once ``gone`` is set: the line did not run to its end


def file_id_for(batch_id: str, kind: str) -> str:
    """The output / error file's id: the same whoever ends the batch, however often."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


class Ownership:
    """The partitions of ``chat.batches`` this gateway runs: its consumer's assignment in the runners'
    group (nothing is read for its records or committed; the group only shares the partitions out)."""

    def __init__(self, kafka: KafkaSettings, on_failure: Callable[[BaseException], None]) -> None:
        from transport import clients

        self._on_failure = on_failure
        self._owned: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._consumer = clients.consumer(kafka, f"{kafka.topic_prefix}chatpipe-batch-runner", {
            "enable.auto.commit": False, "auto.offset.reset": "latest", "session.timeout.ms": 10_000,
            # incremental: a gateway joining or leaving moves only the partitions that change hands, so the
            # batches that stay keep running (the eager protocol revokes everything at every rebalance)
            "partition.assignment.strategy": "cooperative-sticky"})
        self._consumer.subscribe([kafka.topic(BATCHES)], on_assign=self._assigned, on_revoke=self._revoked,
                                 on_lost=self._revoked)
        self._thread = threading.Thread(target=self._run, name="chatpipe-batch-owner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def owned(self) -> set[int]:
        with self._lock:
            return set(self._owned)

    def _assigned(self, _consumer: Any, partitions: list) -> None:
        with self._lock:
            self._owned |= {tp.partition for tp in partitions}
        log.info("batch runner: runs the batches of %s partitions %s", BATCHES, sorted(self.owned()))

    def _revoked(self, _consumer: Any, partitions: list) -> None:
        with self._lock:
            self._owned -= {tp.partition for tp in partitions}

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._consumer.poll(0.5)  # the group's heartbeats and rebalances happen in here
        except BaseException as exc:  # no batch would run here any more, unseen: the gateway exits (failure policy)
            log.exception("batch runner: the ownership consumer failed")
            self._on_failure(exc)
        finally:
            with self._lock:
                self._owned.clear()
            self._consumer.close()  # leaves the group: another gateway takes the partitions at once

    def close(self) -> None:
        self._stop.set()
        self._thread.join(15)


@dataclass
class Running:
    """One batch this gateway runs now."""

    gone: asyncio.Event = field(default_factory=asyncio.Event)  # set: the lines in flight stop
    task: asyncio.Task | None = None


class BatchRunner:
    def __init__(self, kafka: KafkaSettings, service: Any, book: BatchBook, writer: BatchWriter, store: FileStore,
                 keys: Any, app: Any) -> None:
        self.kafka, self.service, self.book, self.writer, self.store = kafka, service, book, writer, store
        self.settings = service.settings
        self.keys, self.app = keys, app
        self.running: dict[str, Running] = {}
        self._watch: asyncio.Task | None = None
        self.ownership: Ownership | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.ownership = Ownership(self.kafka, lambda exc: loop.call_soon_threadsafe(self.service.on_failure, exc))
        self.ownership.start()
        self._watch = asyncio.ensure_future(self._watch_batches())

    async def close(self, timeout_s: float = 15.0) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await self._stop_all(timeout_s)
        if self.ownership is not None:
            await asyncio.to_thread(self.ownership.close)

    async def _watch_batches(self) -> None:
        """Every half second: start what this gateway owns and does not run yet, stop what it no longer owns."""
        partitions = self.writer.partitions[BATCHES]
        while True:
            owned = self.ownership.owned() if self.ownership is not None else set()
            for job in self.book.jobs():
                mine = batch_partition(job.batch_id, partitions) in owned
                running = self.running.get(job.batch_id)
                if mine and job.status in ACTIVE and running is None:
                    self._start(job)
                elif running is not None and not mine:
                    log.info("batch %s: its partition went to another gateway; its lines stop here", job.batch_id)
                    running.gone.set()
            await asyncio.sleep(0.5)

    def _start(self, job: BatchJob) -> None:
        running = Running()
        running.task = asyncio.ensure_future(self._guarded(job, running))
        self.running[job.batch_id] = running

    async def _guarded(self, job: BatchJob, running: Running) -> None:
        try:
            await BatchRun(self, job, running.gone).run()
        except Exception:  # this batch stops here; the next look starts it again from what is stored
            log.exception("batch %s: its run failed; it starts again from its stored answers", job.batch_id)
            await asyncio.sleep(5.0)
        finally:
            self.running.pop(job.batch_id, None)

    async def _stop_all(self, timeout_s: float) -> None:
        for running in self.running.values():
            running.gone.set()
        tasks = [r.task for r in self.running.values() if r.task is not None]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=timeout_s)
            for task in late:
                task.cancel()


class BatchRun:
    """One batch run by this gateway, from what is stored to its end (or until told to stop)."""

    def __init__(self, runner: BatchRunner, job: BatchJob, gone: asyncio.Event) -> None:
        self.runner, self.job, self.gone = runner, job, gone
        self.settings = runner.settings
        self.results: dict[str, BatchLineResult] = {}
        self._changed = False

    def latest(self) -> BatchJob:
        return self.runner.book.get(self.job.batch_id) or self.job

    async def run(self) -> None:
        job = self.latest()
        if job.status is BatchStatus.FINALIZING or job.status is BatchStatus.CANCELLING:
            lines = await self._lines(job)
            if lines is not None:
                self.results = await asyncio.to_thread(read_results, self.runner.kafka, job.batch_id)
                await self._end(job, lines, BatchStatus.CANCELLED if job.cancelling_at and not job.finalizing_at
                                else BatchStatus.COMPLETED)
            return
        lines = await self._lines(job)
        if lines is None:
            return
        self.results = await asyncio.to_thread(read_results, self.runner.kafka, job.batch_id)
        todo = [line for line in lines if line.custom_id not in self.results]
        log.info("batch %s: %d of %d lines to run (%d stored)", job.batch_id, len(todo), len(lines),
                 len(lines) - len(todo))
        span = self.runner.service.tracer.start("batch run", None, INTERNAL, {
            "chatpipe.batch.id": job.batch_id, "chatpipe.tenant": job.tenant, "chatpipe.batch.lines": len(lines),
            "chatpipe.batch.todo": len(todo)})
        reporter = asyncio.ensure_future(self._report())
        try:
            await self._run_lines(todo, span.traceparent)
        finally:
            reporter.cancel()
            span.end()
        await self._publish_counts()
        job = self.latest()
        if self.gone.is_set() and not self._cancelled(job) and not self._expired(job):
            return  # stopped here (the partition moved, the gateway stops): whoever runs it next goes on
        ending = (BatchStatus.CANCELLED if self._cancelled(job) else
                  BatchStatus.EXPIRED if self._expired(job) else BatchStatus.COMPLETED)
        self.results = await asyncio.to_thread(read_results, self.runner.kafka, job.batch_id)
        await self._end(job, lines, ending)

    async def _lines(self, job: BatchJob) -> list[BatchLine] | None:
        try:
            data = await asyncio.to_thread(self.runner.store.read, job.tenant, job.input_file_id)
        except FileStoreError:
            await self._fail(job, "input_file_missing", f"the input file {job.input_file_id} is gone (deleted?)")
            return None
        lines, errors = read_lines(data, job.endpoint)
        if errors:  # checked when the batch was made: the file changed since
            await self._fail(job, errors[0].code, errors[0].message)
            return None
        return lines

    def _cancelled(self, job: BatchJob) -> bool:
        return job.cancelling_at is not None

    def _expired(self, job: BatchJob) -> bool:
        return job.expires_at is not None and time.time() >= job.expires_at

    def _should_stop(self) -> bool:
        job = self.latest()
        if self._cancelled(job) or self._expired(job):
            self.gone.set()
        return self.gone.is_set()

    async def _run_lines(self, todo: list[BatchLine], traceparent: str | None) -> None:
        queue: asyncio.Queue[BatchLine] = asyncio.Queue()
        for line in todo:
            queue.put_nowait(line)

        async def worker() -> None:
            while not queue.empty() and not self._should_stop():
                line = queue.get_nowait()
                result = await self._line(line, traceparent)
                if result is not None:
                    await asyncio.to_thread(self.runner.writer.results, [result])
                    self.results.setdefault(line.custom_id, result)
                    self._changed = True
                    self.runner.service.metrics.batch_lines.labels(
                        "ok" if result.status_code < 400 else "error").inc()

        async def stopper() -> None:  # a cancel or the window's end also stops the lines in flight
            while not self._should_stop():
                await asyncio.sleep(0.5)

        workers = [asyncio.ensure_future(worker()) for _ in range(min(self.settings.batch_concurrency, len(todo)))]
        watch = asyncio.ensure_future(stopper())
        try:
            await asyncio.gather(*workers)
        finally:
            watch.cancel()

    async def _line(self, line: BatchLine, traceparent: str | None) -> BatchLineResult | None:
        """The line's answer once it has one; None when the batch stopped before."""
        job = self.job
        key = self.runner.keys.key_of(job.key_fingerprint) or "revoked"  # no longer in the keys file: 401
        body = dict(line.body)
        if job.endpoint != "/v1/embeddings":
            body["service_tier"] = "flex"  # the batch priority class
        headers = {"authorization": f"Bearer {key}"}  # its deadline: the gateway's first_chunk_timeout_s
        if not (body.get("metadata") or {}).get("conversation_id"):
            headers[MEMORY_HEADER] = "off"  # a line that names no conversation neither recalls nor is remembered
        if traceparent:
            headers["traceparent"] = traceparent
        failures = 0
        while True:
            if self._should_stop():
                return None
            answer = await asgi_call.post(self.runner.app, job.endpoint, body, headers, self.gone)
            if answer.status == _STOPPED and self.gone.is_set():
                return None
            if answer.status in (429, 503):  # the batch class is full, or no worker / broker for now
                await self._wait(_retry_after(answer.headers))
                continue
            if answer.status >= 500 or answer.status == _STOPPED:
                failures += 1
                if failures < LINE_ATTEMPTS:
                    await self._wait(2.0 ** failures)
                    continue
            return _result(job.batch_id, line, answer)

    async def _wait(self, seconds: float) -> None:
        low, high = RETRY_WAIT_S
        try:
            await asyncio.wait_for(self.gone.wait(), min(high, max(low, seconds)))
        except asyncio.TimeoutError:
            pass

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(self.settings.batch_progress_s)
            if self._changed:
                await self._publish_counts()

    def _counts(self) -> dict[str, int]:
        done = self.results.values()
        return {"completed": sum(r.status_code < 400 for r in done), "failed": sum(r.status_code >= 400 for r in done),
                "input_tokens": sum(r.input_tokens for r in done), "output_tokens": sum(r.output_tokens for r in done),
                "cached_tokens": sum(r.cached_tokens for r in done)}

    async def _publish_counts(self) -> None:
        self._changed = False
        await self._publish(replace(self.latest(), **self._counts()))

    async def _publish(self, job: BatchJob) -> BatchJob:
        await asyncio.to_thread(self.runner.writer.publish, job)
        return self.runner.book.apply(job)

    async def _fail(self, job: BatchJob, code: str, message: str) -> None:
        log.warning("batch %s failed: %s", job.batch_id, message)
        await self._publish(replace(self.latest(), errors=[BatchError(code=code, message=message)],
                                    failed_at=int(time.time())))

    async def _end(self, job: BatchJob, lines: list[BatchLine], ending: BatchStatus) -> None:
        """Write the output and error files, then say how the batch ended; tombstone the stored answers."""
        now = int(time.time())
        if ending is BatchStatus.COMPLETED:
            job = await self._publish(replace(self.latest(), finalizing_at=now, **self._counts()))
        unrun = "batch_cancelled" if ending is BatchStatus.CANCELLED else "batch_expired"
        output, errors = [], []
        for line in lines:
            result = self.results.get(line.custom_id)
            if result is None:
                errors.append(_unrun_line(job.batch_id, line, unrun))
            else:
                (output if result.status_code < 400 else errors).append(_output_line(result))
        files = {}
        for kind, rows in (("output", output), ("error", errors)):
            if rows:
                data = "".join(json.dumps(r) + "\n" for r in rows).encode()
                stored = await asyncio.to_thread(self.runner.store.put, job.tenant, f"{job.batch_id}_{kind}.jsonl",
                                                 "batch_output", iter([data]), None, file_id_for(job.batch_id, kind))
                files[f"{kind}_file_id"] = stored.id
        step = {BatchStatus.COMPLETED: "completed_at", BatchStatus.CANCELLED: "cancelled_at",
                BatchStatus.EXPIRED: "expired_at"}[ending]
        final = await self._publish(replace(self.latest(), **self._counts(), **files, **{step: int(time.time())}))
        log.info("batch %s %s: %d completed, %d failed, %d not run", job.batch_id, final.status.value.lower(),
                 final.completed, final.failed, len(lines) - len(self.results))
        await asyncio.to_thread(self.runner.writer.forget_results, job.batch_id, list(self.results))


def _retry_after(headers: dict[str, str]) -> float:
    try:
        value = float(headers.get("retry-after", "5"))
    except ValueError:
        return 5.0
    return value if math.isfinite(value) else 5.0


def _result(batch_id: str, line: BatchLine, answer: asgi_call.Answer) -> BatchLineResult:
    body = answer.json()
    usage = (body.get("usage") if isinstance(body, dict) else None) or {}
    details = usage.get("prompt_tokens_details") or {}
    return BatchLineResult(batch_id=batch_id, custom_id=line.custom_id, line=line.number, status_code=answer.status,
                           request_id=answer.headers.get(REQUEST_HEADER.lower(), ""), body=json.dumps(body),
                           input_tokens=int(usage.get("prompt_tokens") or 0),
                           output_tokens=int(usage.get("completion_tokens") or 0),
                           cached_tokens=int(details.get("cached_tokens") or 0))


def _output_line(result: BatchLineResult) -> dict[str, Any]:
    """A line of the output or error file, in OpenAI's shape."""
    return {"id": f"batch_req_{hashlib.sha256(f'{result.batch_id}/{result.custom_id}'.encode()).hexdigest()[:24]}",
            "custom_id": result.custom_id,
            "response": {"status_code": result.status_code, "request_id": result.request_id,
                         "body": json.loads(result.body)},
            "error": None}


def _unrun_line(batch_id: str, line: BatchLine, code: str) -> dict[str, Any]:
    what = "cancelled" if code == "batch_cancelled" else "expired"
    return {"id": f"batch_req_{hashlib.sha256(f'{batch_id}/{line.custom_id}'.encode()).hexdigest()[:24]}",
            "custom_id": line.custom_id, "response": None,
            "error": {"code": code, "message": f"the batch {what} before this request ran"}}
