"""The inference worker: requests from Kafka into the engine, tokens and answers back to Kafka.

One asyncio loop serves every request as a task: prepare (chat template, checks), generate,
stream ``TokenChunk``s to the request's reply address, produce the ``Response``, wait until the
broker has it, and only then tell the intake the request is finished (commit / ACCEPT). Bad
input is dead-lettered (and answered with an error Response when it decodes); the worker never
stops on it. Consumers live in the intake's and the cancel listener's threads, the engine in
its step thread; this loop only moves small records between them.

Shutdown (``request_stop``, wired to SIGTERM by the CLI): stop taking work, let in-flight
requests finish for ``grace_s``, hand the rest back uncommitted (partition) or RELEASEd (share),
close the consumers (leaving the group), flush the producer, stop the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from inference.engine.engine import Engine
from inference.engine.request import FinishReason as EngineFinish
from inference.engine.streaming import AsyncEngine
from inference.worker.cancels import CancelListener, RecentCancels
from inference.worker.capacity import Capacity
from inference.worker.errors import BadRequestError, PromptTooLongError
from inference.worker.generation import EngineBusy, Generation
from inference.worker.heartbeat import WORKERS_STATUS, worker_status
from inference.worker.intake import Intake, Outcome, WorkItem
from inference.worker.intake_partition import PartitionIntake
from inference.worker.intake_share import ShareIntake
from inference.worker.metrics import WorkerMetrics
from inference.worker.prompts import prepare
from inference.worker.replies import ReplyStream, response_for, send_dead_letter, send_response
from inference.worker.settings import WorkerSettings
from schemas.codec import default_codec
from schemas.records import Cancel, FinishReason, WorkerState, now_ms
from transport.acked_producer import AckedProducer
from transport.settings import KafkaSettings

log = logging.getLogger(__name__)

FINISH = {EngineFinish.STOP: FinishReason.STOP, EngineFinish.LENGTH: FinishReason.LENGTH,
          EngineFinish.ABORTED: FinishReason.CANCELLED}


class Worker:
    def __init__(self, kafka: KafkaSettings, settings: WorkerSettings, engine: Engine, tokenizer: Any,
                 model_name: str) -> None:
        self.kafka = kafka
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        cfg = engine.model.config
        self.max_seq_len = min(engine.settings.max_seq_len,
                               getattr(cfg, "max_position_embeddings", engine.settings.max_seq_len))
        self.capacity = Capacity(*settings.capacity(engine.settings.max_batch))
        self.codec = default_codec()
        intake_cls = ShareIntake if settings.intake == "share" else PartitionIntake
        self.intake: Intake = intake_cls(kafka, settings, self.capacity, self.codec)
        self.producer = AckedProducer(kafka, codec=self.codec, linger_ms=settings.chunk_linger_ms)
        self.metrics = WorkerMetrics()
        self.cancels = CancelListener(kafka, self.codec)
        self.recent_cancels = RecentCancels(settings.cancel_memory)
        self.active: dict[str, tuple[WorkItem, Generation]] = {}  # request_id -> what runs it
        self.tasks: dict[asyncio.Task, WorkItem] = {}
        self.state = WorkerState.STARTING
        self.exit_code = 0
        self._stopping: asyncio.Event | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def request_stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    async def run(self) -> int:
        """Serve until ``request_stop``; returns the process exit code (1 after an engine failure)."""
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self.aengine = AsyncEngine(self.engine, idle_wait_s=0.01)
        self.aengine.start()
        self.metrics.serve(self.settings.metrics_port)
        self.cancels.start(loop, self._on_cancel)
        await asyncio.to_thread(self.cancels.ready.wait, 10.0)
        self.intake.start(loop, self._dispatch, self._on_revoked)
        self.state = WorkerState.SERVING
        heartbeat = asyncio.create_task(self._heartbeat())
        log.info("worker %s serving (intake=%s, in flight <= %d)", self.settings.worker_id, self.settings.intake,
                 self.capacity.max_in_flight)
        await self._stopping.wait()
        self.state = WorkerState.DRAINING
        self._send_status()
        await self._drain()
        heartbeat.cancel()
        await asyncio.to_thread(self.intake.close)
        await asyncio.to_thread(self.cancels.close)
        self.state = WorkerState.STOPPED
        self._send_status()
        await asyncio.to_thread(self.producer.close)
        await asyncio.to_thread(self.aengine.stop)
        log.info("worker %s stopped", self.settings.worker_id)
        return self.exit_code

    async def _drain(self) -> None:
        self.intake.stop_taking()
        pending = set(self.tasks)
        if pending and self.settings.grace_s > 0:
            _, pending = await asyncio.wait(pending, timeout=self.settings.grace_s)
        for task in pending:  # out of time: hand back, uncommitted / RELEASEd
            item = self.tasks[task]
            item.handed_back = True
            if item.record is not None and item.record.request_id in self.active:
                self.active[item.record.request_id][1].cancel()
        if pending:
            log.info("handing back %d unfinished request(s)", len(pending))
            await asyncio.wait(pending, timeout=30)

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
                running[1].cancel()

    def _on_cancel(self, cancel: Cancel) -> None:
        running = self.active.get(cancel.request_id)
        if running is not None:
            running[1].cancel()
        else:
            self.recent_cancels.add(cancel.request_id, cancel.reason)

    # -- one request -------------------------------------------------------------------------------

    async def _serve(self, item: WorkItem) -> None:
        outcome, started = Outcome.HAND_BACK, [False]
        label = "handed_back"
        try:
            if item.error is not None:
                await send_dead_letter(self.producer, item.message, item.error, delivery_count=item.delivery_count)
                outcome, label = Outcome.DEAD, "dead_letter"
                return
            outcome, label = await self._answer(item, started)
        except Exception:  # noqa: BLE001 - engine or broker failure: hand back, stop the worker
            # Not the request's fault (bad input never gets here): another worker, or this one
            # restarted, serves it again. Exit non-zero so a supervisor restarts the process.
            log.exception("serving %s failed; handing it back and stopping", item.message)
            outcome, label = Outcome.HAND_BACK, "failed"
            self.exit_code = 1
            self.request_stop()
        finally:
            self.capacity.release(item.priority, started[0])
            self.intake.finish(item, outcome)
            self.metrics.requests.labels(label).inc()

    async def _answer(self, item: WorkItem, started: list[bool]) -> tuple[Outcome, str]:
        started_at = time.perf_counter()  # the worker's own time on the request starts here
        req = item.record
        attempt = uuid.uuid4().hex[:16]
        trace = item.message.traceparent
        cancelled = self.recent_cancels.pop(req.request_id)
        if cancelled is not None:
            replies = ReplyStream(self.producer, req, self.settings.worker_id, attempt, trace)
            replies.send_error("cancelled", f"cancelled: {cancelled}", FinishReason.CANCELLED)
            response = response_for(req, text="", worker_id=self.settings.worker_id, model=self.model_name,
                                    tokens_in=0, tokens_out=0, queue_ms=0, ttft_ms=0,
                                    finish_reason=FinishReason.CANCELLED, error=f"cancelled: {cancelled}")
            await asyncio.gather(send_response(self.producer, response, attempt=attempt, parent_trace=trace),
                                 *([replies.last_ack] if replies.last_ack is not None else []))
            return Outcome.DONE, "cancelled"
        try:
            prepared = prepare(req, self.tokenizer, self.max_seq_len)
        except BadRequestError as exc:
            return await self._reject(item, exc, attempt, trace), "bad_request"
        first_token_ms = [0]

        def on_first_token() -> None:
            started[0] = True
            first_token_ms[0] = now_ms()
            self.capacity.started(item.priority)

        gen = Generation(self.aengine, self.tokenizer, f"{req.request_id}#{attempt}", prepared, on_first_token)
        self.active[req.request_id] = (item, gen)
        replies = ReplyStream(self.producer, req, self.settings.worker_id, attempt, trace, started_at=started_at)
        final = None
        try:
            while final is None:
                try:
                    async for delta in gen.deltas():
                        if item.revoked or item.handed_back:
                            gen.cancel()
                            continue
                        if delta.finished:
                            final = delta
                            reason = FINISH.get(delta.finish_reason, FinishReason.STOP)
                            replies.send(delta.text, delta.token_id, final=True, finish_reason=reason,
                                         tokens_in=delta.num_prompt_tokens, tokens_out=delta.num_output_tokens,
                                         error_code="cancelled" if reason is FinishReason.CANCELLED else None)
                        elif delta.text:
                            replies.send(delta.text, delta.token_id)
                except EngineBusy:  # only when max_in_flight exceeds the engine's waiting queue
                    await asyncio.sleep(0.05)
                    continue
                if final is None:  # revoked or handed back: answer nothing
                    return Outcome.HAND_BACK, "revoked" if item.revoked else "handed_back"
        except BadRequestError as exc:  # the engine refused it (TOO_LARGE for the KV budget)
            return await self._reject(item, exc, attempt, trace), "bad_request"
        finally:
            if self.active.get(req.request_id, (None,))[0] is item:
                del self.active[req.request_id]
        if item.revoked or item.handed_back:
            return Outcome.HAND_BACK, "revoked" if item.revoked else "handed_back"
        queue_ms = (item.taken_at_ms - req.enqueued_at) + (final.queue_s or 0.0) * 1000
        ttft_ms = (first_token_ms[0] - req.enqueued_at) if first_token_ms[0] else 0.0
        reason = FINISH.get(final.finish_reason, FinishReason.STOP)
        error = None
        if reason is FinishReason.CANCELLED:  # when it stopped tells whether the cancel was prompt
            error = f"cancelled at token {gen.tokens_at_cancel}"
        response = response_for(req, text=replies.text, worker_id=self.settings.worker_id, model=self.model_name,
                                tokens_in=final.num_prompt_tokens, tokens_out=final.num_output_tokens,
                                queue_ms=queue_ms, ttft_ms=ttft_ms, finish_reason=reason, error=error)
        if replies.last_ack is not None:
            # The stream first: a Response that is durable always has its whole stream durable
            # (they go to different partitions, which Kafka does not order against each other).
            await replies.last_ack
        await send_response(self.producer, response, attempt=attempt, parent_trace=trace)
        self._observe(response, final)
        return Outcome.DONE, reason.value.lower()

    async def _reject(self, item: WorkItem, exc: BadRequestError, attempt: str, trace: str | None) -> Outcome:
        """Dead letter with the reason, and an error Response so the asker is not left waiting."""
        req = item.record
        code = "context_length_exceeded" if isinstance(exc, PromptTooLongError) else "invalid_request"
        replies = ReplyStream(self.producer, req, self.settings.worker_id, attempt, trace)
        replies.send_error(code, str(exc))
        response = response_for(req, text="", worker_id=self.settings.worker_id, model=self.model_name,
                                tokens_in=0, tokens_out=0, queue_ms=item.taken_at_ms - req.enqueued_at, ttft_ms=0,
                                finish_reason=FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")
        await asyncio.gather(send_dead_letter(self.producer, item.message, exc),
                             send_response(self.producer, response, attempt=attempt, parent_trace=trace),
                             *([replies.last_ack] if replies.last_ack is not None else []))
        return Outcome.DEAD

    def _observe(self, response: Any, final: Any) -> None:
        m = self.metrics
        m.queue_time.observe(response.queue_ms / 1000)
        if response.ttft_ms:
            m.ttft.observe(response.ttft_ms / 1000)
        if final.tpot_s is not None:
            m.tpot.observe(final.tpot_s)
        m.tokens.inc(response.tokens_out)

    # -- load reports ------------------------------------------------------------------------------

    def _send_status(self) -> None:
        stats = self.engine.stats()
        status = worker_status(self.settings.worker_id, self.model_name, self.state, stats, self.capacity.in_flight)
        self.producer.send(self.kafka.topic(WORKERS_STATUS), status, key=self.settings.worker_id, want_ack=False)
        m = self.metrics
        m.tokens_per_s.set(stats.tokens_per_s)
        m.batch_size.set(stats.running)
        m.in_flight.set(self.capacity.in_flight)
        m.consumer_lag.set(self.intake.lag())

    async def _heartbeat(self) -> None:
        while True:
            self._send_status()
            await asyncio.sleep(self.settings.heartbeat_s)
