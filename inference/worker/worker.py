"""The inference worker: requests from Kafka into the engine, tokens and answers back to Kafka.

One asyncio loop serves every request as a task: check it (reply address, deadline, chat
template), generate, stream ``TokenChunk``s to the request's reply address, produce the
``Response``, wait until the broker has it, and only then tell the intake the request is
finished (commit / ACCEPT). Consumers live in the intake's, the cancel listener's and the
deletion listener's threads, the engine in its step thread; this loop only moves small records
between them. A Deletion (``chat.deletions``) drops the user's cached prefixes on the engine's
step thread and is acknowledged with a ``DeletionAudit`` once that is done.

Failure policy (docs/worker.md), decided in ``_serve``:
- the record's fault (``BadRequestError``: undecodable, invalid, unanswerable reply address,
  expired, delivered too often) is answered: dead letter with the reason, an error final chunk
  where the reply address works, an error Response; the input is committed / REJECTed and the
  worker goes on;
- anything else (engine, broker past librdkafka's retries, a thread of ours that died) is the
  infrastructure's: the request is handed back uncommitted, the worker reports FAILED, stops at
  once and exits 1, for a supervisor to restart it. When that exception is a bug (FATAL) raised
  by one request's own handling, the crash is also counted against its record (partition mode:
  ``crash_counts.py``), which is dead-lettered once it has crashed the worker
  ``max_record_crashes`` times (``PoisonRecordError``) instead of crash-looping its partition.

Choices (issue 23): a request with ``n`` > 1 runs n generations of its prompt at once, each
streaming its own chunks (``choice_index``); when all have ended, each choice's last text, then
the n Responses, then the n end markers, and only then the request is finished (committed): a
crash before that serves all n choices again, as one new attempt. A ``response_format`` gets one
grammar matcher per choice (``constraints.py``); one that does not compile is answered
``invalid_request``. With logprobs, every chunk carries its tokens' logprobs.

Shutdown (``request_stop``, wired to SIGTERM by the CLI): stop taking work, let in-flight
requests finish for ``grace_s``, hand the rest back uncommitted (partition) or RELEASEd (share),
close the consumers (leaving the group), flush the producer, stop the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from inference.engine.engine import Engine
from inference.engine.errors import EngineFailed
from inference.engine.request import FinishReason as EngineFinish
from inference.engine.streaming import AsyncEngine
from inference.worker.cancels import CancelListener, RecentCancels
from inference.worker.capacity import Capacity
from inference.worker.deletions import DeletionListener, RecentDeletions, prefix_cache_audit
from inference.worker.errors import (BadRequestError, ReplyAddressError, RequestExpiredError, TooManyDeliveriesError,
                                     WorkerFailed)
from inference.worker.constraints import Constraints
from inference.worker.generation import Choices, Delta, Generation
from inference.worker.heartbeat import worker_status
from inference.worker.intake import Intake, Outcome, WorkItem
from inference.worker.intake_partition import PartitionIntake
from inference.worker.intake_share import ShareIntake
from inference.worker.metrics import WorkerMetrics
from inference.worker.model_versions import ServedVersions
from inference.worker.prompts import PreparedRequest, prepare
from inference.worker.replies import ReplyStream, response_for, send_dead_letter, send_response
from inference.worker.settings import WorkerSettings
from inference.worker.token_bytes import TokenBytes
from inference.worker.trace_spans import generation_spans
from schemas.codec import default_codec
from schemas.records import Cancel, Deletion, FinishReason, InferenceRequest, WorkerState, now_ms
from schemas.topics import DELETIONS_AUDIT, WORKERS_STATUS
from transport.acked_writer import AckedWriter
from transport.failures import Fault, classify
from transport.admin import TopicAdmin
from transport.reply_address import ReplyAddresses
from transport.settings import KafkaSettings
from transport.spans import Span, Tracer

log = logging.getLogger(__name__)

FINISH = {EngineFinish.STOP: FinishReason.STOP, EngineFinish.LENGTH: FinishReason.LENGTH,
          EngineFinish.ABORTED: FinishReason.CANCELLED,
          EngineFinish.ERROR: FinishReason.ERROR}  # the engine could not go on (e.g. its grammar refused a token)
# Why the worker itself stopped a generation (Generation.stop_reason) -> how the request ended.
STOPPED_BY = {"deadline": FinishReason.TIMEOUT, "lock": FinishReason.TIMEOUT}


class Worker:
    def __init__(self, kafka: KafkaSettings, settings: WorkerSettings, engine: Engine, tokenizer: Any,
                 model_name: str, constraints: Any = None) -> None:
        """``engine``: ours (``inference.engine.Engine``) or one with the same surface (the vLLM
        engine, ``inference.vllm_engine``), which then brings its own ``constraints`` (what turns a
        response_format into the engine's constraint, ``matchers(fmt, n, max_tokens)``)."""
        self.kafka = kafka
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_seq_len = engine.max_seq_len  # the settings' and the model's context
        self.capacity = Capacity(*settings.capacity(engine.settings.max_batch, engine.settings.max_waiting))
        self.token_bytes = TokenBytes(tokenizer)  # logprobs: each token's text and real bytes
        # response_format: one compiler per worker (made on first use), one matcher per choice
        self.constraints = constraints or Constraints(tokenizer, int(engine.vocab_size or len(tokenizer)))
        self.codec = default_codec()
        intake_cls = ShareIntake if settings.intake == "share" else PartitionIntake
        self.tracer = Tracer("inference")  # spans (transport/spans.py, docs/observability.md)
        self.intake: Intake = intake_cls(kafka, settings, self.capacity, self.codec)
        self.intake.tracer = self.tracer
        self.producer = AckedWriter(kafka, codec=self.codec, linger_ms=settings.chunk_linger_ms, tracer=self.tracer)
        admin = TopicAdmin(kafka, timeout_s=settings.kafka_error_budget_s)
        # the one reply-address rule (transport/reply_address.py), the same as streams intake's
        self.reply_addresses = ReplyAddresses.of(kafka, admin.topic_partitions, fresh_s=30.0, recheck_s=1.0)
        self.metrics = WorkerMetrics(model_name)
        self.cancels = CancelListener(kafka, self.codec)
        self.recent_cancels = RecentCancels(settings.cancel_memory)
        self.deletions = DeletionListener(kafka, self.codec)
        self.recent_deletions = RecentDeletions(settings.deletion_memory)
        # the fine-tuned versions of this base model it serves (chat.models; model_versions.py)
        self.versions = ServedVersions(kafka, self.codec, engine, Path(model_name).name, settings.adapter_cache,
                                       settings.version_wait_s)
        self.forgets: set[asyncio.Task] = set()  # deletions being carried out (forget + audit)
        self.active: dict[str, tuple[WorkItem, Choices]] = {}  # request_id -> what runs it
        self.tasks: dict[asyncio.Task, WorkItem] = {}
        self.state = WorkerState.STARTING
        self.failure: BaseException | None = None  # what stopped the worker, when something did
        self.exit_code = 0
        self._stopping: asyncio.Event | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def request_stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    async def run(self) -> int:
        """Serve until ``request_stop``; returns the process exit code (1 after a failure)."""
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self.aengine = AsyncEngine(self.engine)
        self.aengine.start()
        self._set_state(WorkerState.STARTING)
        # + the groups' lag, measured; /ready: serving and holding every version it must (a pod's readiness)
        self.metrics.serve(self.settings.metrics_port, self.kafka, self.settings, ready=self._readiness)
        self.cancels.start(loop, self._on_cancel, self._thread_failed("cancel listener"), self._on_bad_record)
        self.deletions.start(loop, self._on_deletion, self._thread_failed("deletion listener"),
                             self._on_bad_record)
        await asyncio.to_thread(self.cancels.ready.wait, 10.0)
        # Before any request is taken: a deletion sent after a request was served is always seen.
        await asyncio.to_thread(self.deletions.ready.wait, 10.0)
        # the versions it serves, before the first request may name one (its own thread: loads block)
        on_loop = lambda callback: lambda *args: loop.call_soon_threadsafe(callback, *args)
        await asyncio.to_thread(self.versions.start, on_loop(self._thread_failed("model version follower")),
                                on_loop(self._on_bad_record))
        self.intake.start(loop, self._dispatch, self._on_revoked, self._thread_failed("intake"))
        if self.failure is None:
            self._set_state(WorkerState.SERVING)
        heartbeat = asyncio.create_task(self._heartbeat())
        log.info("worker %s serving (intake=%s, in flight <= %d)", self.settings.worker_id, self.settings.intake,
                 self.capacity.max_in_flight)
        await self._stopping.wait()
        if self.failure is None:
            self._set_state(WorkerState.DRAINING)
        self._send_status()
        await self._drain()
        heartbeat.cancel()
        if self.forgets:  # their audits are this worker's acknowledgements: let them reach the broker
            await asyncio.wait(set(self.forgets), timeout=30)
        for name, close in (("intake", self.intake.close), ("cancel listener", self.cancels.close),
                            ("deletion listener", self.deletions.close),
                            ("model version follower", self.versions.close)):
            try:
                await asyncio.to_thread(close)
            except Exception as exc:  # noqa: BLE001 - already reported through _fail; shut down the rest
                self._fail(f"{name} closed with an error", exc)
        await asyncio.to_thread(self.metrics.close)  # the lag measurements' thread
        if self.failure is None:
            self._set_state(WorkerState.STOPPED)
        self._send_status()
        await asyncio.to_thread(self.producer.close)
        await asyncio.to_thread(self.aengine.stop)
        log.info("worker %s stopped (exit code %d)", self.settings.worker_id, self.exit_code)
        return self.exit_code

    async def _drain(self) -> None:
        self.intake.stop_taking()
        pending = set(self.tasks)
        grace = 0.0 if self.failure is not None else self.settings.grace_s  # failed: nothing can be committed
        if pending and grace > 0:
            _, pending = await asyncio.wait(pending, timeout=grace)
        for task in pending:  # out of time: hand back, uncommitted / RELEASEd
            item = self.tasks[task]
            item.handed_back = True
            if item.record is not None and item.record.request_id in self.active:
                self.active[item.record.request_id][1].cancel("handed_back")
        if pending:
            log.info("handing back %d unfinished request(s)", len(pending))
            await asyncio.wait(pending, timeout=30)

    def _fail(self, what: str, exc: BaseException) -> None:
        """The infrastructure's fault: report FAILED, stop at once, exit 1 (the first cause is kept)."""
        self.exit_code = 1
        if self.failure is not None:
            return
        log.error("worker %s failed: %s: %s; stopping", self.settings.worker_id, what, exc, exc_info=exc)
        self.failure = exc
        # WorkerStatus v2: a failed worker says FAILED (readers of later versions read an unknown state as
        # STOPPED, the enum default), never SERVING; it exits right after.
        self._set_state(WorkerState.FAILED)
        try:
            self._send_status()
        except Exception:  # the status is best effort; the exit code is what counts
            log.warning("could not send the FAILED status", exc_info=True)
        self.request_stop()

    def _thread_failed(self, name: str):
        def failed(exc: BaseException) -> None:  # on the loop, from the dying thread
            self._fail(f"the {name} thread died", WorkerFailed(f"the {name} thread died: {exc}"))
        return failed

    def _set_state(self, state: WorkerState) -> None:
        self.state = state
        self.metrics.state.state("FAILED" if self.failure is not None else state.value)

    # -- events from the intake and the cancel listener (on the loop) ------------------------------

    def _dispatch(self, item: WorkItem) -> None:
        task = asyncio.get_running_loop().create_task(self._serve(item))
        self.tasks[task] = item
        task.add_done_callback(self.tasks.pop)

    def _on_revoked(self, items: list[WorkItem]) -> None:
        for item in items:
            item.revoked = True
            running = self.active.get(item.record.request_id) if item.record is not None else None
            if running is not None and running[0] is item:
                running[1].cancel("revoked")

    def _on_cancel(self, cancel: Cancel) -> None:
        running = self.active.get(cancel.request_id)
        if running is not None:
            running[1].cancel()
        else:
            self.recent_cancels.add(cancel.request_id, cancel.reason)

    def _on_bad_record(self, message: Any, exc: Exception) -> None:
        """A record on a broadcast topic (chat.cancels, chat.deletions) that does not decode:
        dead-letter it (a record fault; nothing to stop)."""
        letter = send_dead_letter(self.producer, message, exc)

        def delivered(future: asyncio.Future) -> None:
            if not future.cancelled() and future.exception() is not None:  # a broker fault: the log says so
                log.warning("dead letter of an undecodable record on %s not delivered: %s", message.topic,
                            future.exception())

        letter.add_done_callback(delivered)

    def _on_deletion(self, deletion: Deletion) -> None:
        self.recent_deletions.add(deletion)
        task = asyncio.get_running_loop().create_task(self._forget(deletion))
        self.forgets.add(task)
        task.add_done_callback(self.forgets.discard)

    async def _forget(self, deletion: Deletion) -> None:
        """Drop the user's cached prefixes (a conversation's Deletion drops all of the user's: the
        cache knows users, not conversations), then the audit. A failure is the infrastructure's
        (engine gone, broker past its retries): the worker stops, and its cache goes with it."""
        try:
            dropped = await self.aengine.forget_prefixes(deletion.tenant, deletion.user_id)
            audit = prefix_cache_audit(deletion, self.settings.worker_id)
            await self.producer.send(self.kafka.topic(DELETIONS_AUDIT), audit, key=deletion.user_id)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            self._fail(f"carrying out deletion {deletion.event_id}", exc)
            return
        log.info("deletion %s: %d prefix-cache block(s) of %s/%s dropped", deletion.event_id, dropped,
                 deletion.tenant, deletion.user_id)

    # -- one request -------------------------------------------------------------------------------

    async def _serve(self, item: WorkItem) -> None:
        outcome, started = Outcome.HAND_BACK, [False]
        label = "handed_back"
        try:
            if item.record is None:  # undecodable: nobody to answer, only the dead letter
                await send_dead_letter(self.producer, item.message, item.error, delivery_count=item.delivery_count)
                outcome, label = Outcome.DEAD, "dead_letter"
                return
            outcome, label = await self._answer(item, started)
        except Exception as exc:  # noqa: BLE001 - not the request's fault (those are answered in _answer)
            # Engine or broker failure, or a bug: another worker, or this one restarted, serves it again.
            outcome, label = Outcome.HAND_BACK, "failed"
            if self._raised_by_the_record(item, exc):
                self.intake.record_crash(item, f"{type(exc).__name__}: {exc}")
            self._fail(f"serving {item.message}", exc)
        finally:
            self.capacity.release(item.priority, started[0])
            self.intake.finish(item, outcome)
            self.metrics.requests.labels(label).inc()

    def _raised_by_the_record(self, item: WorkItem, exc: Exception) -> bool:
        """Whether ``exc`` is a crash to count against ``item``'s record: a bug (FATAL: no outage, no
        known fault of the record) raised by its own handling, the first failure of this worker. Not
        the engine's failure (its step thread serves every request: any of them, or none, may be the
        cause), nor a part of the worker that died."""
        return (self.failure is None and item.record is not None and self.aengine.failure is None
                and not isinstance(exc, (EngineFailed, WorkerFailed)) and classify(exc) is Fault.FATAL)

    async def _answer(self, item: WorkItem, started: list[bool]) -> tuple[Outcome, str]:
        """Serve or answer ``item``; a ``BadRequestError`` anywhere is answered by ``_reject``."""
        started_at = time.perf_counter()  # the worker's own time on the request starts here
        req = item.record
        attempt = uuid.uuid4().hex[:16]
        m = item.message
        # The request's span on this hop: what the worker sends for it (chunks, Response, dead letter)
        # are its children, so they carry its traceparent.
        span = self.tracer.process(m.topic, m.traceparent, partition=m.partition, offset=m.offset,
                                   start_ns=item.taken_at_ms * 1_000_000 or None,
                                   attributes={"chatpipe.request_id": req.request_id, "chatpipe.attempt": attempt,
                                               "chatpipe.worker_id": self.settings.worker_id}).activate()
        try:
            outcome, label = await self._answer_in(item, started, started_at, attempt, span)
            span.set("chatpipe.outcome", label)
            return outcome, label
        except BaseException as exc:
            span.fail(exc)
            raise
        finally:
            span.end()

    async def _answer_in(self, item: WorkItem, started: list[bool], started_at: float, attempt: str,
                         span: Span) -> tuple[Outcome, str]:
        req = item.record
        trace = span.traceparent
        try:
            # before anything is sent there; an empty reply_to gets no chunks (Replies.enabled), like None
            if problem := await self.reply_addresses.problem(req.reply_to or None, req.reply_partition):
                raise ReplyAddressError(problem)
            if item.error is not None:  # e.g. delivered too often: answered with that reason
                raise item.error
            check_deadline(req, item.taken_at_ms, "the worker took it")
            cancelled = self.recent_cancels.pop(req.request_id)
            if cancelled is not None:
                return await self._answer_cancelled(req, cancelled, attempt, trace), "cancelled"
            prepared = prepare(req, self.tokenizer, self.max_seq_len)
            prepared = replace(prepared, adapter=await self.versions.adapter_for(req.model))
            drill = self.settings.drill_crash_on
            if drill and req.messages and req.messages[-1].content == drill:
                raise RuntimeError("fault drill: the request's last message is CHATPIPE_WORKER_DRILL_CRASH_ON")
            return await self._generate(item, prepared, started, started_at, attempt, span)
        except BadRequestError as exc:
            label = "expired" if isinstance(exc, RequestExpiredError) else "bad_request"
            span.fail(exc)
            return await self._reject(item, exc, attempt, trace), label

    async def _answer_cancelled(self, req: InferenceRequest, reason: str, attempt: str, trace: str | None) -> Outcome:
        replies = ReplyStream(self.producer, req, self.settings.worker_id, attempt, trace, tracer=self.tracer)
        replies.send_error("cancelled", f"cancelled: {reason}", FinishReason.CANCELLED)
        response = response_for(req, text="", worker_id=self.settings.worker_id, model=self.model_name,
                                tokens_in=0, tokens_out=0, queue_ms=0, ttft_ms=0,
                                finish_reason=FinishReason.CANCELLED, error=f"cancelled: {reason}")
        await replies.delivered()
        await send_response(self.producer, response, attempt=attempt, parent_trace=trace)
        return Outcome.DONE

    async def _generate(self, item: WorkItem, prepared: PreparedRequest, started: list[bool], started_at: float,
                        attempt: str, span: Span) -> tuple[Outcome, str]:
        req = item.record
        trace = span.traceparent
        first_token_ms = [0]
        first_token_ns = [0]
        generation_ns = time.time_ns()

        def on_first_token() -> None:  # the first token of any choice: the request runs
            if started[0]:
                return
            started[0] = True
            first_token_ms[0] = now_ms()
            first_token_ns[0] = time.time_ns()
            self.capacity.started(item.priority)

        n = prepared.n
        matchers = None
        if prepared.response_format is not None:  # compiling may take a while: off the loop
            matchers = await asyncio.to_thread(self.constraints.matchers, prepared.response_format, n,
                                              prepared.params.max_new_tokens)
        covered = self.recent_deletions.covers(req.tenant, req.user_id, req.created_at)  # by a Deletion since
        token_bytes = self.token_bytes if prepared.logprobs else None
        gens = [Generation(self.aengine, self.tokenizer, f"{req.request_id}#{attempt}" + (f"#{i}" if i else ""),
                           prepared, on_first_token, tenant=req.tenant, user_id=req.user_id,
                           cache_prefix=not covered, on_token=self.metrics.token,
                           constraint=matchers[i] if matchers else None, token_bytes=token_bytes)
                for i in range(n)]
        choices = Choices(gens)
        self.active[req.request_id] = (item, choices)
        replies = [ReplyStream(self.producer, req, self.settings.worker_id, attempt, trace, started_at=started_at,
                               tracer=self.tracer, choice_index=i, interval_s=self.settings.chunk_interval_ms / 1000)
                   for i in range(n)]
        timer = self._stop_timer(item, choices)
        runs: list[asyncio.Future] = []
        try:  # one engine group: n > 1 siblings share the prompt's KV
            await choices.submit(lambda: check_deadline(req, now_ms(), "the engine could take it"))
            runs = [asyncio.ensure_future(self._run_choice(item, gen, stream)) for gen, stream in zip(gens, replies)]
            finals = await asyncio.gather(*runs)
        except BaseException as exc:  # one choice failed (reply address, deadline, engine): stop them all
            choices.cancel("reply_address" if isinstance(exc, ReplyAddressError) else "failed")
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if self.active.get(req.request_id, (None,))[0] is item:
                del self.active[req.request_id]
        if item.revoked or item.handed_back or any(final is None for final in finals):
            return Outcome.HAND_BACK, "revoked" if item.revoked else "handed_back"
        reasons = [self._reason(final, gen) for final, gen in zip(finals, gens)]
        if all(reason is FinishReason.TIMEOUT and gen.stop_reason == "deadline" and final.num_output_tokens == 0
               for reason, gen, final in zip(reasons, gens, finals)):
            raise RequestExpiredError(f"the deadline passed while it waited for the engine (deadline_at "
                                      f"{req.deadline_at})")
        first = finals[0]
        answered_by = prepared.adapter or self.model_name  # the exact version: Response, turn, dataset rows
        generation_spans(span, answered_by, req, first, reasons[0], queued_from_ns=span.start_ns,
                         started_ns=generation_ns, first_token_ns=first_token_ns[0], ended_ns=time.time_ns(),
                         answer=replies[0].text + (first.text or ""))
        queue_ms = (item.taken_at_ms - req.enqueued_at) + (first.queue_s or 0.0) * 1000
        ttft_ms = (first_token_ms[0] - req.enqueued_at) if first_token_ms[0] else 0.0
        # The whole text first, then the Response, then the final chunk, an end marker with no text:
        # - a Response that is durable has all its text durable in its attempt's stream (what a
        #   reader pairing the kept Response with its stream needs, docs/worker.md);
        # - read-your-writes: the Response is on the broker before the client can have the final
        #   chunk, so a follow-up sent once it has it finds this turn in its context (intake waits
        #   for record to reach the end of chat.responses, streams/recorded.py). A crash between the
        #   Response and the end marker serves the request again (a new attempt with its own whole
        #   stream); record drops the second Response as a repeat.
        # With n choices: every choice's text, then the n Responses, then the n end markers.
        for final, stream in zip(finals, replies):
            if final.text or final.token_id is not None or stream.index > 0:  # (an empty one only for its ack)
                stream.send(final.text, final.token_id, ack=True, logprob=final.logprob)
        await asyncio.gather(*(stream.delivered() for stream in replies))
        responses, errors = [], []
        for i, (final, gen, reason, stream) in enumerate(zip(finals, gens, reasons, replies)):
            error, error_code = self._stop_error(reason, gen, final)
            errors.append(error_code)
            responses.append(response_for(req, text=stream.text, worker_id=self.settings.worker_id,
                                          model=answered_by, tokens_in=final.num_prompt_tokens,
                                          tokens_out=final.num_output_tokens, queue_ms=queue_ms, ttft_ms=ttft_ms,
                                          finish_reason=reason, error=error, choice_index=i,
                                          cached_tokens=final.num_cached_tokens))
        await asyncio.gather(*(send_response(self.producer, response, attempt=attempt, parent_trace=trace)
                               for response in responses))
        for final, reason, error_code, stream in zip(finals, reasons, errors, replies):
            stream.send("", None, final=True, finish_reason=reason, tokens_in=final.num_prompt_tokens,
                        tokens_out=final.num_output_tokens, cached_tokens=final.num_cached_tokens,
                        error_code=error_code)
        await asyncio.gather(*(stream.delivered() for stream in replies))
        response = responses[0]
        self.metrics.finished(response.finish_reason.value, queue_s=response.queue_ms / 1000,
                              ttft_s=response.ttft_ms / 1000 if response.ttft_ms else None,
                              e2e_s=response.total_ms / 1000, tpot_s=first.tpot_s, prompt_tokens=response.tokens_in)
        return Outcome.DONE, reasons[0].value.lower()

    async def _run_choice(self, item: WorkItem, gen: Generation, replies: ReplyStream) -> Delta | None:
        """One choice to its end: its chunks streamed as they come; returns its final delta (its
        last text not yet sent), or None when the request was revoked or handed back meanwhile."""
        final = None
        async for delta in gen.deltas():
            if item.revoked or item.handed_back:
                gen.cancel("handed_back")
                continue
            if delta.finished:
                final = delta
            elif delta.text:
                replies.send(delta.text, delta.token_id, logprob=delta.logprob)
            else:  # no text yet (a partial character, a possible stop string): with the next chunk
                replies.hold(delta.token_id, delta.logprob)
        return final  # None: revoked or handed back, answer nothing

    def _reason(self, final: Delta, gen: Generation) -> FinishReason:
        reason = FINISH.get(final.finish_reason, FinishReason.STOP)
        if final.finish_reason is EngineFinish.ABORTED and gen.stop_reason in STOPPED_BY:
            reason = STOPPED_BY[gen.stop_reason]  # stopped by us, not by a Cancel
        return reason

    def _stop_timer(self, item: WorkItem, gen: Choices) -> asyncio.TimerHandle | None:
        """Stop the generation at the request's deadline, or (share) before its record lock runs out."""
        limits = [(at, why) for at, why in ((item.record.deadline_at, "deadline"), (item.lock_until_ms, "lock"))
                  if at is not None]
        if not limits:
            return None
        at, why = min(limits)
        return asyncio.get_running_loop().call_later(max(0.0, (at - now_ms()) / 1000), gen.cancel, why)

    def _stop_error(self, reason: FinishReason, gen: Generation, final: Delta) -> tuple[str | None, str | None]:
        """(Response.error, final chunk's error_code) of a generation that ended with ``reason``."""
        if reason is FinishReason.ERROR:  # the engine ended it (e.g. the grammar refused a sampled token)
            return final.error or "the engine could not go on", "internal_error"
        if reason is FinishReason.CANCELLED:  # when it stopped tells whether the cancel was prompt
            return f"cancelled at token {gen.tokens_at_cancel}", "cancelled"
        if reason is not FinishReason.TIMEOUT:
            return None, None
        if gen.stop_reason == "deadline":
            return f"the deadline passed at token {gen.tokens_at_cancel}", None
        if gen.stop_reason == "lock":
            # A partial answer, not an error: the text so far is kept (OpenAI: finish_reason "length").
            return (f"stopped at token {gen.tokens_at_cancel}: the share record lock "
                    f"({self.settings.share_record_lock_ms / 1000:.0f} s) was running out"), None
        return None, None

    async def _reject(self, item: WorkItem, exc: BadRequestError, attempt: str, trace: str | None) -> Outcome:
        """Dead letter with the reason, an error final chunk where the reply address works, and an
        error Response, so the asker is not left waiting."""
        req = item.record
        replies = ReplyStream(self.producer, req, self.settings.worker_id, attempt, trace, tracer=self.tracer)
        if not isinstance(exc, ReplyAddressError):
            try:
                replies.send_error(exc.error_code, str(exc), exc.finish_reason)
            except ReplyAddressError as refused:
                log.warning("request %s: no error chunk: %s", req.request_id, refused)
        response = response_for(req, text="", worker_id=self.settings.worker_id, model=self.model_name,
                                tokens_in=0, tokens_out=0, queue_ms=item.taken_at_ms - req.enqueued_at, ttft_ms=0,
                                finish_reason=exc.finish_reason, error=f"{type(exc).__name__}: {exc}")
        count = item.delivery_count if isinstance(exc, TooManyDeliveriesError) else None
        await asyncio.gather(send_dead_letter(self.producer, item.message, exc, delivery_count=count),
                             send_response(self.producer, response, attempt=attempt, parent_trace=trace))
        try:
            await replies.delivered()
        except ReplyAddressError as refused:  # the dead letter and the Response are the answer then
            log.warning("request %s: error chunk not delivered: %s", req.request_id, refused)
        return Outcome.DEAD

    # -- load reports ------------------------------------------------------------------------------

    def _readiness(self) -> tuple[bool, str]:
        """What ``/ready`` answers (the metrics server's thread): SERVING and no CANARY/LIVE version of its base
        model still being fetched (a FAILED one is not waited for: it is marked so on chat.models)."""
        pending = self.versions.pending()
        if self.state is not WorkerState.SERVING:
            return False, f"not serving: {self.state.value}"
        if pending:
            return False, f"loading model versions: {', '.join(pending)}"
        return True, f"serving {self.model_name} and {', '.join(self.versions.held()) or 'no fine-tuned version'}"

    def _send_status(self) -> None:
        stats = self.engine.stats()
        status = worker_status(self.settings.worker_id, self.model_name, self.state, stats, self.capacity.in_flight,
                               self.versions.held())
        self.producer.send(self.kafka.topic(WORKERS_STATUS), status, key=self.settings.worker_id, want_ack=False)
        self.metrics.engine(stats, self.capacity.in_flight)

    async def _heartbeat(self) -> None:
        while True:
            if self.aengine.failed:  # an idle worker would only find out at its next request
                self._fail("the engine failed", self.aengine.failure)
            try:
                self._send_status()
            except Exception as exc:  # noqa: BLE001 - a worker that cannot report is taken as gone by the gateways
                self._fail("the heartbeat failed", exc)
                return
            await asyncio.sleep(self.settings.heartbeat_s)


def check_deadline(req: InferenceRequest, at_ms: int, when: str) -> None:
    """``RequestExpiredError`` when ``req``'s deadline is at or before ``at_ms`` (epoch ms)."""
    if req.deadline_at is not None and at_ms >= req.deadline_at:
        raise RequestExpiredError(f"the deadline passed {at_ms - req.deadline_at} ms before {when} "
                                  f"(deadline_at {req.deadline_at})")
