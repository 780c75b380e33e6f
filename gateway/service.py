"""One request's path through the gateway: a record out, its TokenChunks back.

``submit`` (chat) and ``submit_completion`` (text completions) call ``gateway/translate.py`` once
for the request's ``PromptRequest`` (every 400 / 404 / 403 is answered there), take a slot of the
backlog (``admit``, ``admission.py``: 429 when its first token cannot come before its deadline, 503
when no worker serves its model; ``max_pending`` bounds the gateway's memory), then produce the record (keyed by
conversation id, reply address = this gateway's reply topic) and wait for the broker's
acknowledgement, at most ``delivery_timeout_s`` (then 503: a broker that is away frees the
request's backlog slot in seconds). ``replies`` yields each choice's increments as they come
(``Delta``: text, its tokens' logprobs, the finish reason on the choice's last), the request's
``n`` choices interleaved; per choice the newest serving attempt wins
(``transport.dedupe.AnswerText``; ``LogprobsShown`` does the same for the logprobs); with tools,
each choice's output is read for calls (``responses.ToolCallStream``). ``cancel`` sends a
``Cancel`` (the client went away, or it timed out) so the worker stops generating.

Not here: HTTP (``app.py``), the request bodies (``openai_api.py``), turning them into records
(``translate.py``), OpenAI's answer objects (``responses.py``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from gateway.admission import Admission, total, work_of
from transport.fleet import Fleet, Work
from gateway.keys import Principal, owns_request, resolve_user
from gateway.metrics import GatewayMetrics
from gateway.openai_api import ChatCompletionRequest, CompletionRequest, OpenAIError, service_tier_served
from gateway.replies import Reply, ReplyReader, ReplyReaderStopped, ensure_reply_topic
from gateway.responses import FINISH, ToolCallStream, error_for_chunk, reader_stopped_error, reads_tool_calls
from gateway.responses import finish_reason as tool_finish_reason
from gateway.settings import GatewaySettings
from gateway.translate import check_model, chat_request_to_prompt, completion_request_to_prompts
from schemas.codec import default_codec
from schemas.errors import EncodeError
from schemas.records import (
    Cancel,
    Feedback,
    FeedbackKind,
    PromptRequest,
    TokenChunk,
    TokenLogprob,
    now_ms,
)
from schemas.topics import CANCELS, FEEDBACK, PROMPTS
from transport.acked_writer import AckedWriter
from transport.dedupe import AnswerText
from transport.errors import DeliveryError
from transport.failures import Fault, classify
from transport.model_catalog import ModelCatalog
from transport.settings import KafkaSettings
from transport.spans import CONSUMER, SERVER, Span, Tracer

log = logging.getLogger(__name__)


@dataclass
class LogprobsShown:
    """Which logprob entries of one choice the client has, across serving attempts (as AnswerText
    does for the text): a retried attempt's entries are shown from the count already shown on."""

    attempt: str | None = None
    attempt_tokens: int = 0
    shown_tokens: int = 0

    def feed(self, chunk: TokenChunk, attempt: str | None) -> list[TokenLogprob]:
        """The new entries of a chunk that AnswerText took as part of the answer."""
        if attempt != self.attempt:
            self.attempt, self.attempt_tokens = attempt, 0
        entries = chunk.logprobs or []
        start = max(0, self.shown_tokens - self.attempt_tokens)
        self.attempt_tokens += len(entries)
        new = entries[start:]
        self.shown_tokens += len(new)
        return new


@dataclass
class Choice:
    """One of a request's ``n`` answers, as the client has been shown it."""

    index: int
    logprobs: list[TokenLogprob] | None = None  # None: the request did not ask for them
    text_parts: list[str] = field(default_factory=list)
    final: TokenChunk | None = None
    answer: AnswerText = field(default_factory=AnswerText)
    shown: LogprobsShown = field(default_factory=LogprobsShown)
    tools: ToolCallStream | None = None  # the request has tools: the answer is read for tool calls

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def finish_reason(self) -> str:
        reason = FINISH[(self.final.finish_reason if self.final else None) or "STOP"]
        return tool_finish_reason(self.tools, reason) if self.tools is not None else reason

    def message(self) -> tuple[str | None, list[dict] | None]:
        """The answer's ``content`` and ``tool_calls`` (None: no calls; with tools, a content of
        only whitespace is None) once the choice ended."""
        if self.tools is None:
            return self.text, None
        return self.tools.text, [c.openai() for c in self.tools.calls] or None


@dataclass(frozen=True, slots=True)
class Delta:
    """What ``GatewayService.replies`` yields: choice ``index``'s new text and its tokens' logprobs
    (None: not asked); ``finish_reason`` (OpenAI's) on the choice's last one."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    parts: list[dict] | None = None  # with tools: OpenAI's delta objects for ``text`` (content / tool_calls)


@dataclass
class Submitted:
    request_id: str
    conversation_id: str
    model: str
    queue: asyncio.Queue
    received_at: float  # perf_counter when the HTTP request arrived
    deadline_at: int  # epoch ms: no first token by then -> 504 (the PromptRequest's deadline_at)
    choices: list[Choice]  # the request's n answers
    created: int = field(default_factory=lambda: int(time.time()))
    first_token_at: float | None = None
    done: bool = False
    tenant: str = ""  # whose backlog share this request takes (admit)
    service_tier: str = "default"  # echoed in the answer: the tier its priority class serves (openai_api.py)
    work: Work = field(default_factory=Work)  # what it asks of a worker, in tokens, until its first token (admit)
    span: Span | None = None  # the HTTP request's span: the PromptRequest is produced as its child
    read_span: Span | None = None  # reading the answer's chunks from the reply topic
    chunks: int = 0
    # A chunk said the answer came from streams' response cache (TokenChunk v4: every chunk of a hit says so;
    # the X-Chatpipe-Cache: hit answer header, set from the chunks read before the headers are sent).
    response_cached: bool = False

    @property
    def complete(self) -> bool:
        """Every choice's final chunk came."""
        return all(c.final is not None for c in self.choices)

    @property
    def tokens_in(self) -> int:
        """The prompt's tokens (each choice's final says the same; the largest, should one differ)."""
        return max((c.final.tokens_in or 0 for c in self.choices if c.final), default=0)

    @property
    def cached_tokens(self) -> int:
        """Of ``tokens_in``, those taken from the engine's prefix cache (OpenAI's
        ``usage.prompt_tokens_details.cached_tokens``; a final chunk before TokenChunk v4 says None: 0).
        Like ``tokens_in`` the prompt counts once, as the choice that computed it read it: the smallest
        of the choices' (choice 0's: its n > 1 siblings start after it and take the prompt's blocks it
        just computed from the cache, which is no hit of earlier work)."""
        return min((c.final.cached_tokens or 0 for c in self.choices if c.final), default=0)

    @property
    def tokens_out(self) -> int:
        """Completion tokens over all choices (OpenAI's usage counts every choice's)."""
        return sum(c.final.tokens_out or 0 for c in self.choices if c.final)


class GatewayService:
    def __init__(self, kafka: KafkaSettings, settings: GatewaySettings, metrics: GatewayMetrics) -> None:
        self.kafka = kafka
        self.settings = settings
        self.metrics = metrics
        self.codec = default_codec()
        self.gateway_id = settings.instance_id()
        self.reply_topic = ""
        self.reader: ReplyReader | None = None
        self.producer: AckedWriter | None = None
        self.pending: dict[str, Submitted] = {}
        self.tracer = Tracer("gateway")  # spans (transport/spans.py, docs/observability.md)
        self._mean_duration_s = 5.0  # EWMA of request durations: the memory guard's Retry-After
        self.fleet = Fleet(settings.worker_stale_s)  # the workers' reports, read with the replies
        self.admission = Admission(settings, metrics, self.fleet)
        # chat.models: the fine-tuned versions a request may name, per tenant (transport/model_catalog.py)
        self.models = ModelCatalog(kafka, self.codec)
        self.on_failure: Callable[[BaseException], None] = lambda exc: None  # server.py: stop the server

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.reply_topic = await asyncio.to_thread(ensure_reply_topic, self.kafka, self.gateway_id,
                                                   self.settings.reply_retention_ms)
        self.producer = AckedWriter(self.kafka, codec=self.codec, linger_ms=1.0,
                                      delivery_timeout_s=self.settings.delivery_timeout_s, tracer=self.tracer)
        self.reader = ReplyReader(self.kafka, self.reply_topic, self.codec, self.settings.reply_error_budget_s,
                                  on_status=self.fleet.update)
        await asyncio.to_thread(self.reader.start, loop, self._reader_stopped)
        await asyncio.to_thread(self.models.start, lambda exc: loop.call_soon_threadsafe(self._models_stopped, exc))
        self.fleet.listening()
        log.info("gateway %s: replies on %s", self.gateway_id, self.reply_topic)

    @property
    def ready(self) -> bool:
        return self.reader is not None and self.reader.ready

    @property
    def failure(self) -> BaseException | None:
        """Why the reply reader stopped (the process exits 1); None while it reads."""
        return self.reader.failure if self.reader is not None else None

    def _reader_stopped(self, exc: BaseException) -> None:
        """No reply can reach this gateway any more: /healthz says 503, new requests get 503, and the
        process exits 1 (``on_failure``) for its supervisor or Kubernetes to start it again."""
        log.critical("gateway %s: its reply reader stopped (%s: %s); exiting to be restarted", self.gateway_id,
                     type(exc).__name__, exc)
        self.on_failure(exc)

    def _models_stopped(self, exc: BaseException) -> None:
        """The chat.models follower died: versions would go stale unseen (a rolled-back one still taken)."""
        log.critical("gateway %s: its chat.models follower stopped (%s: %s); exiting to be restarted",
                     self.gateway_id, type(exc).__name__, exc)
        self.on_failure(exc)

    def check_serving(self) -> None:
        """503 once the reply reader has stopped: the request could be sent but never answered here."""
        if self.failure is not None:
            self.metrics.requests.labels("rejected_unavailable").inc()
            raise reader_stopped_error(self.failure)

    async def close(self) -> None:
        for sub in list(self.pending.values()):  # the server stopped before they finished
            self.cancel(sub, "gateway_shutdown")
        if self.producer is not None:
            await asyncio.to_thread(self.producer.close, 10.0)
        if self.reader is not None:
            await asyncio.to_thread(self.reader.close)
        await asyncio.to_thread(self.models.close)

    # -- one request -------------------------------------------------------------------------------

    def admit(self, prompt: PromptRequest, work: Work) -> None:
        """429 / 503 when the prompt (asking ``work`` of a worker) is not taken (``admission.py``: the
        memory guard, a worker serving its model, its estimated first token against its deadline)."""
        not_started = total(sub.work for sub in self.pending.values()
                            if sub.first_token_at is None and sub.model == prompt.model)
        held = sum(1 for sub in self.pending.values() if sub.tenant == prompt.tenant)
        retry = max(1, min(60, math.ceil(self._mean_duration_s / max(1, len(self.pending)) * 4)))
        # the workers that can answer: those holding a named version, else those of its base model
        fleet_model = check_model(prompt.model, self.settings.models, prompt.tenant, self.models)
        self.admission.check(prompt, len(self.pending), held, not_started, guard_retry_s=retry, work=work,
                             fleet_model=fleet_model)

    async def submit(self, principal: Principal, body: ChatCompletionRequest, conversation_id: str | None,
                     received_at: float, traceparent: str | None = None, timeout_s: float | None = None,
                     cache: bool | None = None, memory: bool = True,
                     route: str = "/v1/chat/completions") -> Submitted:
        """A chat request: its PromptRequest (``translate.chat_request_to_prompt``: 400 / 404 / 403
        before anything else), its slot of the backlog (429), the record produced. ``conversation_id``:
        the one the client named in the header (None: the body's metadata, or a new conversation);
        ``traceparent`` (the HTTP header, when the client sent one) makes the request's span part of
        the client's trace; ``cache``: what the X-Chatpipe-Cache header asked (``translate.cache_header``);
        ``memory``: what X-Chatpipe-Memory asked (``translate.memory_header``); ``route``: the HTTP route its
        span names (``/v1/responses`` submits its chat request here too)."""
        prompt = chat_request_to_prompt(body, principal, self.settings, conversation_id=conversation_id,
                                        reply_to=self.reply_topic, timeout_s=timeout_s, cache=cache, models=self.models,
                                        memory=memory)
        return await self._produce(prompt, received_at, route, "chat", traceparent, param="messages")

    async def submit_completion(self, principal: Principal, body: CompletionRequest, received_at: float,
                                traceparent: str | None = None, timeout_s: float | None = None,
                                cache: bool | None = None) -> list[Submitted]:
        """A text-completions request (``completions.py``): one PromptRequest per prompt
        (``translate.completion_request_to_prompts``: raw_prompt, no messages; streams passes it
        through without a chat template or memory), each taking its slot of the backlog and produced;
        ``replies``, ``cancel`` and ``finish`` serve each as they serve a chat request. When one cannot
        be produced, those already produced are cancelled."""
        prompts = completion_request_to_prompts(body, principal, self.settings, reply_to=self.reply_topic,
                                                timeout_s=timeout_s, cache=cache, models=self.models)
        subs: list[Submitted] = []
        try:
            for prompt in prompts:
                subs.append(await self._produce(prompt, received_at, "/v1/completions", "text_completion", traceparent,
                                                param="prompt"))
        except BaseException:
            for sub in subs:
                self.cancel(sub, "request_refused")
            raise
        return subs

    async def _produce(self, prompt: PromptRequest, received_at: float, route: str, operation: str,
                       traceparent: str | None, *, param: str) -> Submitted:
        """Take the request's slot of the backlog (``admit``: 429), start its SERVER span and produce its
        prompt; what the reply side keeps of the request while it waits for its answer. A prompt that
        cannot be encoded or that the broker refuses for its own sake (``transport.failures``: the
        record's fault) is a 400 naming ``param``, one the broker does not take a 503."""
        self.check_serving()
        work = work_of(prompt)
        self.admit(prompt, work)
        sampling = prompt.sampling
        tools = reads_tool_calls(sampling.response_format)  # tool_choice not "none": answers are read for calls
        choices = [Choice(i, [] if sampling.logprobs else None, tools=ToolCallStream() if tools else None)
                   for i in range(sampling.n)]
        sub = Submitted(prompt.request_id, prompt.conversation_id, prompt.model,
                        self.reader.register(prompt.request_id), received_at, prompt.deadline_at, choices,
                        tenant=prompt.tenant, work=work, service_tier=service_tier_served(prompt.priority))
        sub.span = self.tracer.start(
            f"POST {route}", traceparent, SERVER,
            {"http.request.method": "POST", "http.route": route, "chatpipe.request_id": sub.request_id,
             "gen_ai.operation.name": operation, "gen_ai.request.model": sub.model, "chatpipe.stream": prompt.stream},
            start_ns=time.time_ns() - int((time.perf_counter() - sub.received_at) * 1e9)).activate()  # log lines: its ids
        self.pending[sub.request_id] = sub
        self.metrics.pending.set(len(self.pending))
        try:
            await self.producer.send(self.kafka.topic(PROMPTS), prompt, key=sub.conversation_id,
                                     parent_trace=sub.span.traceparent)
        except EncodeError as exc:  # e.g. a lone surrogate (valid JSON, not encodable text)
            self.finish(sub, "invalid")
            raise OpenAIError(400, f"the request cannot be encoded: {exc}", param=param,
                              code="invalid_value") from None
        except DeliveryError as exc:
            self.finish(sub, "produce_failed")
            if classify(exc) is Fault.RECORD:  # e.g. larger than the broker takes: the request's fault
                raise OpenAIError(400, f"the pipeline refused the request: {exc}", param=param,
                                  code="invalid_value") from None
            raise OpenAIError(503, f"the pipeline did not take the request: {exc}", type="server_error",
                              code="kafka_unavailable") from None
        except BaseException:
            self.finish(sub, "error")  # never leave a slot of the backlog taken by a request that is gone
            raise
        return sub

    async def replies(self, sub: Submitted) -> AsyncIterator[Delta]:
        """Each choice's increments as they come; ends once every choice's final chunk came (each
        choice's last Delta carries its finish reason).

        Raises OpenAIError when the pipeline answered with an error chunk (of any choice: the
        request failed) or went silent.
        """
        while True:
            if sub.first_token_at is None:  # until the deadline the PromptRequest carries
                timeout = max(0.0, (sub.deadline_at - now_ms()) / 1000)
                waited = round((sub.deadline_at - sub.created * 1000) / 1000)  # the request's own deadline
            else:
                timeout = waited = self.settings.chunk_timeout_s
            try:
                reply: Reply = await asyncio.wait_for(sub.queue.get(), timeout)
            except asyncio.TimeoutError:
                self.cancel(sub, "gateway_timeout")
                raise OpenAIError(504, f"no answer from the pipeline within {waited:g} s", type="server_error",
                                  code="timeout") from None
            if isinstance(reply, ReplyReaderStopped):
                self.cancel(sub, "gateway_unavailable")
                raise reader_stopped_error(reply)
            chunk = reply.chunk
            if not 0 <= chunk.choice_index < len(sub.choices):
                log.warning("request %s: a chunk of choice %d, of %d asked; dropped", sub.request_id,
                            chunk.choice_index, len(sub.choices))
                continue
            choice = sub.choices[chunk.choice_index]
            if choice.final is not None:  # a late duplicate after the choice ended
                continue
            text = choice.answer.feed(chunk, reply.attempt)
            if text is None:
                continue
            new_logprobs = choice.shown.feed(chunk, reply.attempt) if choice.logprobs is not None else None
            self._read(sub, reply)
            sub.response_cached = sub.response_cached or chunk.response_cached
            if chunk.is_final and chunk.error_code:
                raise error_for_chunk(chunk.error_code, chunk.error)
            if sub.first_token_at is None:
                sub.first_token_at = time.perf_counter()
                self.metrics.ttft.observe(sub.first_token_at - sub.received_at)
            if text:
                choice.text_parts.append(text)
            if new_logprobs:
                choice.logprobs.extend(new_logprobs)
            parts = None
            if choice.tools is not None:
                parts = choice.tools.feed(text) if text else []
                if chunk.is_final:
                    parts += choice.tools.end()
            if chunk.is_final:
                choice.final = chunk
                yield Delta(choice.index, text, new_logprobs, choice.finish_reason, parts)
                if sub.complete:
                    self._end_read(sub)
                    return
            elif text or new_logprobs:
                yield Delta(choice.index, text, new_logprobs, parts=parts)

    def cancel(self, sub: Submitted, reason: str) -> None:
        """Tell the workers to stop this generation (fire and forget: a lost cancel costs compute only)."""
        if sub.done or self.producer is None:
            return
        self.producer.send(self.kafka.topic(CANCELS), Cancel(request_id=sub.request_id,
                                                             conversation_id=sub.conversation_id, reason=reason),
                           key=sub.conversation_id, want_ack=False)
        self.metrics.cancels.inc()
        self.finish(sub, "cancelled")

    def _read(self, sub: Submitted, reply: Reply) -> None:
        """The reply read's span: from the first chunk to the final one, linked to the worker's stream."""
        sub.chunks += 1
        if sub.read_span is None and sub.span is not None:
            sub.read_span = self.tracer.start(
                f"receive {self.reply_topic}", sub.span.traceparent, CONSUMER,
                {"messaging.system": "kafka", "messaging.operation.type": "receive",
                 "messaging.destination.name": self.reply_topic, "chatpipe.request_id": sub.request_id},
                links=[reply.traceparent] if reply.traceparent else None)
        if reply.chunk.is_final and reply.chunk.error_code:  # else: once every choice's final came (replies)
            self._end_read(sub)

    @staticmethod
    def _end_read(sub: Submitted) -> None:
        if sub.read_span is not None and not sub.read_span.ended:
            sub.read_span.set("messaging.batch.message_count", sub.chunks).end()

    def finish(self, sub: Submitted, outcome: str) -> None:
        if sub.done:
            return
        self._end_read(sub)
        if sub.span is not None:
            sub.span.set("chatpipe.outcome", outcome)
            if sub.complete:
                sub.span.update({"gen_ai.usage.input_tokens": sub.tokens_in,
                                 "gen_ai.usage.output_tokens": sub.tokens_out})
            if outcome not in ("ok", "cancelled"):
                sub.span.fail(outcome)
            sub.span.end()
        sub.done = True
        self.pending.pop(sub.request_id, None)
        self.reader.unregister(sub.request_id)
        duration = time.perf_counter() - sub.received_at
        if outcome == "ok":
            self._mean_duration_s = 0.8 * self._mean_duration_s + 0.2 * duration
            self.metrics.duration.observe(duration)
            self.metrics.tokens.inc(sub.tokens_out)
        self.metrics.requests.labels(outcome).inc()
        self.metrics.pending.set(len(self.pending))

    # -- feedback ----------------------------------------------------------------------------------

    async def feedback(self, principal: Principal, *, request_id: str, conversation_id: str, kind: FeedbackKind,
                       edited_text: str | None, comment: str | None, user: str | None) -> str:
        """Feedback on one of this key's requests: the request id must carry the MAC of this key, user
        and conversation (``keys.owns_request``), else 404: no key rates another's answers."""
        resolved = resolve_user(principal, user)
        if not owns_request(principal, request_id, resolved.user_id, conversation_id):
            raise OpenAIError(404, f"no request {request_id[:80]!r} of this API key in conversation "
                                   f"{conversation_id[:80]!r}" + (f" for user {user[:64]!r}" if user else "") +
                              ": feedback is accepted for the key's own requests, with the request id, conversation "
                              "id and user of the request (X-Chatpipe-Request-Id, X-Chatpipe-Conversation-Id)",
                              param="request_id", code="request_not_found")
        record = Feedback(conversation_id=conversation_id, user_id=resolved.user_id, tenant=principal.tenant,
                          request_id=request_id, kind=kind, edited_text=edited_text, comment=comment)
        try:
            await self.producer.send(self.kafka.topic(FEEDBACK), record, key=conversation_id)
        except DeliveryError as exc:
            raise OpenAIError(503, f"feedback not stored: {exc}", type="server_error", code="kafka_unavailable") from None
        return record.event_id
