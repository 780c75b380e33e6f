"""What the worker writes: token chunks to the asker's reply address, one Response per request,
dead letters. Every record of one serving attempt carries the ``chatpipe-attempt`` header
(``transport.dedupe``) so a reader can pair a Response with the chunks of the same attempt.

A request with n choices has one ``ReplyStream`` per choice (TokenChunk v3 ``choice_index``; its
``index`` counts per choice). A chunk carries every token generated since the previous chunk
(``token_ids``; a token whose text is held back, a partial character or a possible stop string,
rides on the next chunk) and, with logprobs, one ``TokenLogprob`` per token id, in order.

``interval_s`` (the worker's ``chunk_interval_ms``): time is cut in windows of that length, on the
monotonic clock, the same for every stream of the worker; a stream sends at most one chunk per
window, and the text of the tokens that come later in the window rides on its next chunk. The first
chunk, the text sent with an ack and the final chunk never wait. The windows are shared so that the
streams of one batch send in the same engine step: the chunks of one step to one reply partition
are one produce request, and one fetch answered to each reader of it, which is what the broker
spends its time on when it shares a few cores with the model (docs/worker.md, "Chunks and the broker").

Not here: deciding what to write (``worker.py``); encoding and delivery (``transport``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import NoReturn

from confluent_kafka import KafkaException

from inference.worker.errors import ReplyAddressError
from schemas.records import FinishReason, InferenceRequest, Response, TokenChunk, TokenLogprob, now_ms
from schemas.topics import RESPONSES
from transport import dead_letters, tracing
from transport.acked_writer import AckedWriter
from transport.dedupe import ATTEMPT_HEADER
from transport.errors import DeliveryError
from transport.failures import Fault, classify
from transport.message import ConsumedMessage
from transport.spans import PRODUCER, Span, Tracer

COMPONENT = "inference-worker"
# On the first chunk of an attempt: microseconds from the worker starting on the request (chat
# template, engine, detokenizer) until that chunk was sent. A client's time to first token minus
# this is what the Kafka hops and the worker's intake added (bench/worker.py measures it so).
ENGINE_TIME_HEADER = "chatpipe-engine-us"


@dataclass
class ReplyStream:
    """The chunks of one serving attempt, in order, and the acknowledgement of the last one."""

    producer: AckedWriter
    request: InferenceRequest
    worker_id: str
    attempt: str
    parent_trace: str | None
    index: int = 0
    text_parts: list[str] = field(default_factory=list)
    last_ack: asyncio.Future | None = None
    started_at: float | None = None  # perf_counter when the worker started on the request
    # One "send <reply topic>" span for the whole stream, its context on every chunk (a span per
    # token would cost more than the chunk); ended once the last chunk is on the broker.
    tracer: Tracer | None = None
    chunk_span: Span | None = None
    final_sent: bool = False
    choice_index: int = 0
    held_ids: list[int] = field(default_factory=list)  # tokens since the last chunk, not yet sent
    held_logprobs: list[TokenLogprob] = field(default_factory=list)
    interval_s: float = 0.0  # the window: at most one chunk in it that is not final (0: a chunk per text)
    sent_parts: int = 0  # how many of text_parts have gone out in chunks; the rest rides on the next one
    last_window: int | None = None  # the window of the last chunk sent

    @property
    def enabled(self) -> bool:
        return bool(self.request.reply_to)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def headers(self) -> list[tuple[str, bytes]]:
        headers = [(ATTEMPT_HEADER, self.attempt.encode("ascii"))]
        if self.tracer is not None:
            if self.chunk_span is None:
                self.chunk_span = self.tracer.start(
                    f"send {self.request.reply_to}", self.parent_trace, PRODUCER,
                    {"messaging.system": "kafka", "messaging.operation.type": "send",
                     "messaging.destination.name": self.request.reply_to,
                     "messaging.destination.partition.id": str(self.request.reply_partition),
                     "chatpipe.request_id": self.request.request_id})
            headers.append((tracing.HEADER, self.chunk_span.traceparent.encode("ascii")))
        if self.index == 0 and self.started_at is not None:
            engine_us = int((time.perf_counter() - self.started_at) * 1e6)
            headers.append((ENGINE_TIME_HEADER, str(engine_us).encode("ascii")))
        return headers

    def hold(self, token_id: int | None, logprob: TokenLogprob | None = None) -> None:
        """A token that completes no text yet: it goes out with the next chunk."""
        if token_id is not None:
            self.held_ids.append(token_id)
            if logprob is not None:
                self.held_logprobs.append(logprob)

    def send(self, text: str, token_id: int | None, *, final: bool = False, finish_reason: FinishReason | None = None,
             tokens_in: int | None = None, tokens_out: int | None = None, error_code: str | None = None,
             error: str | None = None, ack: bool = False, logprob: TokenLogprob | None = None,
             cached_tokens: int | None = None) -> None:
        """One chunk; the final one carries how the request ended (finish reason, usage with the prompt
        tokens taken from the prefix cache, error). ``delivered()`` then waits for the final chunk, or
        for the last one sent with ``ack``."""
        self.text_parts.append(text)
        self.hold(token_id, logprob)
        if not self.enabled:
            self.held_ids, self.held_logprobs = [], []
            return
        window = int(time.monotonic() / self.interval_s) if self.interval_s > 0 else None
        if not (final or ack) and window is not None and window == self.last_window:
            return  # its text stays in text_parts and rides on the next chunk
        text = "".join(self.text_parts[self.sent_parts:])
        self.sent_parts = len(self.text_parts)
        token_ids, logprobs = self.held_ids, self.held_logprobs
        self.held_ids, self.held_logprobs = [], []
        self.last_window = window
        chunk = TokenChunk(request_id=self.request.request_id, conversation_id=self.request.conversation_id,
                           index=self.index, text=text, token_ids=token_ids,
                           is_final=final, worker_id=self.worker_id, finish_reason=finish_reason,
                           tokens_in=tokens_in, tokens_out=tokens_out, cached_tokens=cached_tokens,
                           error_code=error_code, error=error, choice_index=self.choice_index, logprobs=logprobs if self.request.sampling.logprobs else None)
        try:
            delivery = self.producer.send(self.request.reply_to, chunk, key=self.request.request_id,
                                          partition=self.request.reply_partition, headers=self.headers(),
                                          parent_trace=self.parent_trace, want_ack=final or ack)
        except KafkaException as exc:  # refused before it was queued (e.g. a partition outside the topic)
            self._raise_fault(exc)
        if final or ack:  # chunks of one partition land in order: the last one's ack covers them all
            self.last_ack = delivery
        self.final_sent = self.final_sent or final
        self.index += 1

    async def delivered(self) -> None:
        """Wait until the broker has the whole stream. A refusal that is the request's fault (the
        reply address, the record) raises ``ReplyAddressError``; any other ``DeliveryError`` is the
        broker's and propagates as it is."""
        if self.last_ack is None:
            return
        try:
            await self.last_ack
        except DeliveryError as exc:
            if self.chunk_span is not None:
                self.chunk_span.fail(exc)
            self._raise_fault(exc)
        finally:
            if self.final_sent and self.chunk_span is not None:
                self.chunk_span.set("messaging.batch.message_count", self.index).end()

    def _raise_fault(self, exc: BaseException) -> NoReturn:
        """``ReplyAddressError`` when the refusal is the record's fault (its reply address), else
        ``exc`` as it is (the broker's)."""
        if classify(exc, address_from_record=True) is not Fault.RECORD:
            raise exc
        where = f"{self.request.reply_to}[{self.request.reply_partition}]"
        raise ReplyAddressError(f"the reply address {where} refused a chunk: {exc}") from exc

    def send_error(self, error_code: str, error: str, finish_reason: FinishReason = FinishReason.ERROR) -> None:
        """A lone final chunk for a request that is not served, so the asker is not left waiting."""
        self.send("", None, final=True, finish_reason=finish_reason, tokens_in=0, tokens_out=0, cached_tokens=0,
                  error_code=error_code, error=error)


def response_for(req: InferenceRequest, *, text: str, worker_id: str, model: str, tokens_in: int, tokens_out: int,
                 queue_ms: float, ttft_ms: float, finish_reason: FinishReason, error: str | None = None,
                 choice_index: int = 0, cached_tokens: int = 0) -> Response:
    completed = now_ms()
    return Response(
        request_id=req.request_id, conversation_id=req.conversation_id, user_id=req.user_id, tenant=req.tenant,
        text=text, model=model, worker_id=worker_id, tokens_in=tokens_in, tokens_out=tokens_out,
        queue_ms=max(0.0, queue_ms), ttft_ms=max(0.0, ttft_ms), total_ms=float(max(0, completed - req.enqueued_at)),
        finish_reason=finish_reason, error=error, created_at=req.created_at, completed_at=completed,
        choice_index=choice_index, cached_tokens=cached_tokens,
    )


def send_response(producer: AckedWriter, response: Response, *, attempt: str, parent_trace: str | None) -> asyncio.Future:
    topic = producer.settings.topic(RESPONSES)
    return producer.send(topic, response, key=response.conversation_id,
                         headers=[(ATTEMPT_HEADER, attempt.encode("ascii"))], parent_trace=parent_trace)


def send_dead_letter(producer: AckedWriter, message: ConsumedMessage, error: BaseException,
                     *, delivery_count: int | None = None) -> asyncio.Future:
    """The original record byte for byte, with the reason (and the delivery count when known)."""
    return dead_letters.send_dead_letter(producer, message, error, COMPONENT, delivery_count=delivery_count)
