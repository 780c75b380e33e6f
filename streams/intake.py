"""The intake agent: ``chat.prompts`` -> ``InferenceRequest``s with assembled context.

Per batch (``batching``: adaptive, up to n prompts while they keep arriving, closed as soon as none
more came within ``intake_batch_idle_s``, at most the window, taken by ``streams/faust_runtime/``;
then split by prompt tokens, see ``batching.py``):
decode and validate every prompt (a bad one is dead-lettered and the rest go on), embed all
prompts of the run in one call, recall memory for all of them in one call, outside the state lock
and within ``recall_timeout_s`` (from every
conversation of the tenant's user for ``MemoryScope.USER``, from the prompt's own conversation
only for ``CONVERSATION``: docs/memory.md "Memory scoping"; a raw prompt, PromptRequest v5
``raw_prompt`` from POST /v1/completions, is neither embedded nor recalled for), assemble each
context (``context.py``), remember each request as pending in its conversation's state (record
needs the prompt text when the answer comes back; each conversation's state is written to the
table once per batch, before any of the batch's requests is produced) and produce the
``InferenceRequest`` keyed by conversation id to the topic of its priority. Reply address,
priority and deadline are carried over.

A prompt of a conversation with a request still pending waits, before its batch is assembled, for
the record agent to record every response already on ``chat.responses`` (read-your-writes: a
follow-up sent right after its answer's final chunk sees that answer, ``recorded.py``).

Memory is an enhancement, not a dependency (the seeds: availability over strict consistency,
slightly stale context is fine). Recall gets one retry budget, ``recall_timeout_s`` (2 s), and no
lock is held meanwhile; when memory has not answered by then (Qdrant slow, stopped or away) the
prompts are served with their recent turns only and marked ``memory_degraded`` (on the
InferenceRequest, on the pending request and so on the turn, and in
``chatpipe_streams_memory_degraded_prompts_total``). What recall returns is checked again under the
lock against the state as it is then (a turn recorded meanwhile is in the recent window: not twice)
and against the erasure registry (a user forgotten meanwhile: none of theirs).

The response cache (``response_cache.py``): once a prompt's context is assembled, its key (tenant,
model version, the assembled messages, every sampling field) is looked up, one pipelined round trip
for the batch; a hit is answered here through the normal reply path (``cache_answers.py``: a final
chunk and a Response flagged ``response_cached``, recorded as a turn as usual) and never reaches a
worker; a miss goes on with its key on its pending entry, under which the record agent stores the
answer. A request whose output is not a function of its key (sampled without a seed, n > 1,
logprobs, opted out) bypasses it, counted by reason; so does every request while Redis is away.

Before that, a prompt whose reply address cannot be answered or whose deadline has passed is
refused (``refusals.py``); once its context is assembled, a prompt with a ``deadline_at`` whose first
token the inference fleet cannot deliver by then (the gateway's estimate, ``transport/fleet.py``, from
the workers' reports: ``fleet_follower.py``) is refused at once with the estimate (a dead letter
``DeadlineUnreachableError`` and a final chunk, finish reason OVERLOADED, ``error_code``
``deadline_unreachable``, "retry after N s") instead of waiting in the queue to expire: the gateway's
429 for a producer that writes to ``chat.prompts`` itself. No report, no serving worker or no measured
rate refuses nothing: the topic is the queue, and a worker that comes back serves it.

The batch is acked only once every record it produced (requests, dead letters, error chunks) is on
the broker; broker faults are retried, and past the retry budget the batch stays unacked and the
process exits (``faults.py``), so it is read again.

No Faust here: ``Intake.handle`` takes the batch's messages and an outbox (``streams/ports.py``), the
table is a mapping; the Faust agent that feeds it is ``faust_runtime.agents.faust_agent``.
Tests without Faust: tests/streams/test_agent_logic.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

from confluent_kafka import KafkaException

from formats.chat_tokens import ChatTemplateError
from schemas.errors import DecodeError
from schemas.records import FinishReason, InferenceRequest, MemoryScope, PromptRequest, now_ms
from schemas.topics import inference_requests_topic
from streams.batching import split_by_tokens
from streams.cache_answers import CachedAnswers
from streams.context import Segment, assemble_context
from streams.dead_letters import DeadLetters, event_headers, receive_batch
from streams.erasures import ErasureRegistry
from streams.errors import DeadlineUnreachableError, InvalidPromptError, PromptTooLongError
from streams.faults import Retrier
from streams.metrics import StreamsMetrics
from streams.ports import BatchRule, Message, Outbox
from streams.prompts import ParsedPrompt, parse_prompt
from streams.recorded import RecordedOffsets
from streams.refusals import Refusals
from streams.response_cache import CacheKey, CachedAnswer, ResponseCache
from streams.services import StreamsServices
from streams.settings import StreamsSettings
from streams.state import ConversationState, PendingRequest, state_key
from transport import tracing
from transport.failures import Fault, OutageError, classify
from transport.fleet import Fleet, Work, deadline_shortfall
from transport.model_catalog import ModelCatalog, ModelChoiceError
from transport.partitioning import partition_of
from transport import spans
from transport.spans import Span

log = logging.getLogger(__name__)


def recall_conversation(request: PromptRequest) -> str | None:
    """The conversation recall is limited to: its own for MemoryScope CONVERSATION (a user the
    producer does not vouch for, e.g. a gateway key serving many people without ``user``); None
    (every conversation of the tenant's user) for USER."""
    return request.conversation_id if request.memory_scope is MemoryScope.CONVERSATION else None


def recalls(prompt: "_Prompt") -> bool:
    """Whether a prompt is embedded and recalls memory: a chat prompt with memory on."""
    return not prompt.parsed.raw and prompt.request.memory


@dataclass(slots=True)
class _Prompt:
    message: Message
    request: PromptRequest
    parsed: ParsedPrompt
    span: Span  # "process chat.prompts": its request is produced as its child
    model: str = ""  # the exact model that answers it, once chosen (Intake._choose_model)


class Intake:
    def __init__(self, settings: StreamsSettings, services: StreamsServices, table: Any,
                 out_topics: dict[str, Any], dead_letters: DeadLetters, refusals: Refusals,
                 retrier: Retrier, recorded: RecordedOffsets | None = None, partitions: int = 1,
                 metrics: StreamsMetrics | None = None, erasures: ErasureRegistry | None = None,
                 fleet: Fleet | None = None, cache: ResponseCache | None = None,
                 cached_answers: CachedAnswers | None = None, models: ModelCatalog | None = None) -> None:
        self.settings = settings
        # chat.models (transport/model_catalog.py): which version answers each conversation; None: the
        # request's model as it is
        self.models = models
        self.batching = BatchRule(settings.intake_batch_size, settings.intake_batch_window_s,
                                  settings.intake_batch_idle_s)
        self.recorded = recorded  # how far record has got on chat.responses (recorded.py); None: never wait
        self.partitions = partitions  # of chat.responses: where a conversation's responses are
        self.services = services
        self.table = table  # conversations: state_key -> ConversationState value
        self.out_topics = out_topics  # catalog name -> Faust topic
        self.dead_letters = dead_letters
        self.refusals = refusals
        self.retrier = retrier
        # Recall's one budget: a few quick tries (the next Qdrant peer may answer), never past recall_timeout_s.
        self.recall_retrier = Retrier(settings.recall_timeout_s, backoff_s=0.05, max_backoff_s=0.5)
        self.erasures = erasures if erasures is not None else ErasureRegistry()
        self.fleet = fleet  # the workers' reports (fleet_follower.py); None: no deadline is estimated
        # The response cache (response_cache.py) and how a hit is answered (cache_answers.py); None: no cache.
        self.cache = cache if cached_answers is not None else None
        self.cached_answers = cached_answers
        self._cache_keys: dict[str, CacheKey] = {}  # request id -> key, for the batch being assembled
        self._taken = time.perf_counter()  # when the batch in hand was taken (handle)
        self.metrics = metrics or StreamsMetrics()  # observed here; served by the app (streams/metrics.py)
        self.served = 0
        self.batches = 0
        self.repeats = 0  # prompts read again whose request was answered already (not served twice)
        self.unrecorded = 0  # batches assembled after recorded_wait_s with answers still unrecorded
        self.memory_degraded = 0  # prompts served without recall: memory did not answer within recall_timeout_s
        self.unreachable = 0  # prompts refused: the fleet's estimate of their first token is past their deadline

    async def handle(self, messages: Sequence[Message], outbox: Outbox) -> None:
        """Serve or refuse every prompt of ``messages``; returns once all they produced is durable."""
        self.metrics.intake_batch_size.observe(len(messages))
        tracer = self.services.tracer
        self._taken = time.perf_counter()  # a cached answer's time is counted from here
        start_ns = receive_batch(tracer, self.settings.app_id, messages)
        prompts: list[_Prompt] = []
        for m in messages:
            try:
                request = self.services.codec.decode(m.value, PromptRequest, topic=m.topic,
                                                     partition=m.partition, offset=m.offset)
            except DecodeError as exc:
                await self.dead_letters.send(m, exc, outbox)
                continue
            span = tracer.process(m.topic, tracing.find(event_headers(m)), group=self.settings.app_id,
                                  partition=m.partition, offset=m.offset, start_ns=start_ns,
                                  attributes={"chatpipe.request_id": request.request_id}).activate()
            if not await self.refusals.admit(m, request, outbox):
                span.set("chatpipe.outcome", "refused").end()
                continue
            try:
                prompts.append(_Prompt(m, request, parse_prompt(request, self.settings.context_tokens), span))
            except InvalidPromptError as exc:
                await self.refusals.refuse(m, request, exc, "invalid_request", outbox)
                span.fail(exc).end()
        if prompts:
            await self._await_recorded(prompts)
            tokens = self.services.counter.text_tokens([p.parsed.prompt for p in prompts])
            for run in split_by_tokens(prompts, tokens, self.settings.intake_batch_tokens):
                await self.serve(run, outbox)
        sent = time.perf_counter()
        await outbox.deliver()
        for prompt in prompts:  # served (or refused) and durable
            prompt.span.end()
        spans.deactivate()
        log.debug("intake batch of %d prompt(s) on the broker %.1f ms after its last send", len(messages),
                  (time.perf_counter() - sent) * 1e3)

    async def _await_recorded(self, prompts: list[_Prompt]) -> None:
        """Read-your-writes (recorded.py): a conversation with a request still pending may have its
        answer on chat.responses, not yet recorded; wait for the record agent to reach the end of
        those conversations' partitions. Not under the state lock: record needs it to catch up."""
        if self.recorded is None:
            return
        partitions = {partition_of(p.request.conversation_id, self.partitions) for p in prompts
                      if self._has_pending(p.request)}
        if not partitions:
            return
        started = time.perf_counter()
        started_ns = time.time_ns()
        try:
            short = await self.recorded.wait_for_end(partitions, self.settings.recorded_wait_s)
        except KafkaException as exc:  # the broker did not say (within 5 s): assemble as we can; a
            # broker that stays away fails this batch's produce, which the outbox retries (faults.py)
            log.warning("could not learn how far chat.responses is recorded (%s); assembling without waiting", exc)
            return
        if short:
            self.unrecorded += 1
            log.warning("responses partition(s) %s: %s response(s) still unrecorded after %.1f s; the "
                        "follow-ups' contexts may miss those answers", sorted(short), sum(short.values()),
                        self.settings.recorded_wait_s)
        log.debug("intake waited %.1f ms for record (partitions %s)", (time.perf_counter() - started) * 1e3,
                  sorted(partitions))
        ended_ns = time.time_ns()
        for p in prompts:
            if partition_of(p.request.conversation_id, self.partitions) in partitions:
                p.span.child("wait for record", start_ns=started_ns,
                             attributes={"chatpipe.unrecorded": sum(short.values()) if short else 0}).end(ended_ns)

    def _has_pending(self, request: PromptRequest) -> bool:
        value = self.table.get(state_key(request.tenant, request.user_id, request.conversation_id))
        return bool(value and value.get("pending"))

    async def serve(self, run: list[_Prompt], outbox: Outbox) -> None:
        """One batch: one embedding call, one recall call, one InferenceRequest per prompt."""
        from streams.memory import RecallQuery

        services = self.services
        started, started_ns = time.perf_counter(), time.time_ns()
        # A raw prompt (PromptRequest v5 raw_prompt, POST /v1/completions) recalls nothing: not embedded;
        # nor does a prompt with memory off (v8 ``memory``: a batch line that names no conversation).
        chat = [i for i, p in enumerate(run) if recalls(p)]
        # reuse: a prompt asked again lately (a popular question) is not embedded again (embeddings.py)
        vectors = await services.embedder.aencode([run[i].parsed.prompt for i in chat], reuse=True) if chat else []
        embedded, embedded_ns = time.perf_counter(), time.time_ns()
        # What recall skips (the recent window, offered anyway) is read without the lock: no await in between.
        queries = [RecallQuery(tenant=run[i].request.tenant, user_id=run[i].request.user_id, vector=vectors[j],
                               exclude_turn_ids=self._recent_turn_ids(run[i].request),
                               conversation_id=recall_conversation(run[i].request))
                   for j, i in enumerate(chat)]
        chat_hits, degraded = await self._recall(queries)
        recalled_at, recalled_ns = time.perf_counter(), time.time_ns()
        async with services.state_lock:
            by_key: dict[str, ConversationState] = {}  # two prompts of one conversation share its state
            states = [self._state(p.request, by_key) for p in run]
            recalled: list[list[Any]] = [[] for _ in run]
            for i, hits in zip(chat, chat_hits):
                recalled[i] = self._still_recallable(hits, states[i])
            self.metrics.embed_seconds.observe(embedded - started)
            self.metrics.recall_seconds.observe(recalled_at - embedded)
            batch = {"chatpipe.batch.size": len(run)}
            for prompt, hits in zip(run, recalled):
                if not recalls(prompt):  # neither embedded nor recalled for
                    continue
                prompt.span.child("embed", start_ns=started_ns, attributes=batch).end(embedded_ns)
                prompt.span.child("recall", start_ns=embedded_ns,
                                  attributes={**batch, "chatpipe.recall.hits": len(hits),
                                              "chatpipe.memory_degraded": degraded}).end(recalled_ns)
            self._cache_keys = {}
            ready = [(prompt, state, out) for prompt, state, hits in zip(run, states, recalled)
                     if (out := await self._prepare(prompt, state, hits, outbox, degraded)) is not None]
            cached = await self._cached(ready)
            # State first, then the requests: a response can never find its conversation without its
            # pending entry. One changelog write per conversation per batch, not one per prompt (each
            # write serialises the whole state, pending requests included, to the changelog).
            for key in dict.fromkeys(state.key for _, state, _ in ready):
                self.table[key] = by_key[key].to_value()
            for (prompt, _, out), entry in zip(ready, cached):
                if entry is None:
                    await self._send(prompt, out, outbox)
                else:  # a hit: answered here, its Response recorded as a worker's would be (cache_answers.py)
                    answering = prompt.span.child("answer from the response cache")
                    await self.cached_answers.answer(prompt.message, out, entry, outbox, answering.traceparent,
                                                     self._taken)
                    answering.end()
                    self.metrics.cache_hit_seconds.observe(time.perf_counter() - self._taken)
        self.batches += 1
        log.debug("intake batch of %d: embed %.1f ms, recall %.1f ms, assemble+produce %.1f ms", len(run),
                  (embedded - started) * 1e3, (recalled_at - embedded) * 1e3, (time.perf_counter() - recalled_at) * 1e3)

    async def _cached(self, ready: list[tuple[_Prompt, ConversationState, InferenceRequest]]) -> list[CachedAnswer | None]:
        """The cached answer of each prompt of ``ready`` (None: a miss, a bypass, no cache). The one network
        call made under the state lock, on purpose: the pending entries of hits and misses are written
        together right after it, and it is bounded (one pipelined round trip per batch within the cache's
        ``timeout_s``, 100 ms, skipped for ``retry_after_s`` after a failure: response_cache.py)."""
        if self.cache is None:
            return [None] * len(ready)
        asked = [(i, key) for i, (_, _, out) in enumerate(ready) if (key := self._cache_keys.get(out.request_id))]
        looked_ns = time.time_ns()
        found = await self.cache.lookup([key for _, key in asked], erased=self.erasures.erased)
        found_ns = time.time_ns()
        cached: list[CachedAnswer | None] = [None] * len(ready)
        for (i, _), entry in zip(asked, found):
            cached[i] = entry
        for (prompt, _, out), entry in zip(ready, cached):
            outcome = "hit" if entry is not None else "miss" if out.request_id in self._cache_keys else "bypass"
            prompt.span.set("chatpipe.response_cache", outcome)
            if outcome != "bypass":
                prompt.span.child("response cache lookup", start_ns=looked_ns,
                                  attributes={"chatpipe.response_cache": outcome,
                                              "chatpipe.batch.size": len(asked)}).end(found_ns)
        return cached

    async def _recall(self, queries: list[Any]) -> tuple[list[list[Any]], bool]:
        """Memory's hits for ``queries`` and whether recall was given up (degraded): one budget,
        ``recall_timeout_s``, for the tries and the wait. An outage or a late answer degrades; a bug
        (FATAL) is raised, never hidden as a degraded context."""
        services, budget = self.services, self.settings.recall_timeout_s
        if not queries:
            return [], False
        try:
            return await asyncio.wait_for(self.recall_retrier.call(
                "memory recall", services.in_memory_thread, services.memory.recall_many, queries), budget), False
        except asyncio.TimeoutError:  # a call queued behind a hung one is cancelled before it starts
            why = f"no answer within {budget:g} s"
        except OutageError as exc:
            why = str(exc)
        except Exception as exc:  # classified: an outage degrades, anything else is raised
            if classify(exc) is not Fault.TRANSIENT:
                raise
            why = f"{type(exc).__name__}: {exc}"
        self.memory_degraded += len(queries)  # chatpipe_streams_memory_degraded_prompts (metrics.py)
        log.warning("memory did not answer (%s): %d prompt(s) served with their recent turns only", why, len(queries))
        return [[] for _ in queries], True

    def _recent_turn_ids(self, request: PromptRequest) -> list[str]:
        """The turn ids of the conversation's recent window as the table holds it now (no state decoded)."""
        value = self.table.get(state_key(request.tenant, request.user_id, request.conversation_id))
        return [t["turn_id"] for t in value.get("recent", ())] if value else []

    def _still_recallable(self, hits: list[Any], state: ConversationState) -> list[Any]:
        """``hits`` without turns that reached the recent window while recall ran (they are offered
        anyway) and without turns of a user or conversation forgotten meanwhile."""
        recent = {t.turn_id for t in state.recent}
        return [h for h in hits if h.turn.turn_id not in recent and not self.erasures.erases_record(h.turn)]

    def _state(self, request: PromptRequest, by_key: dict[str, ConversationState]) -> ConversationState:
        key = state_key(request.tenant, request.user_id, request.conversation_id)
        if key not in by_key:
            value = self.table.get(key)
            by_key[key] = (ConversationState(request.tenant, request.user_id, request.conversation_id)
                           if value is None else ConversationState.from_value(value))
        return by_key[key]

    async def _prepare(self, prompt: _Prompt, state: ConversationState, hits: list[Any],
                       outbox: Outbox, memory_degraded: bool = False) -> InferenceRequest | None:
        """The request's context, and its pending entry in ``state`` (not yet written to the table);
        None when the prompt cannot fit the context (it is dead-lettered) or was answered already."""
        request, parsed = prompt.request, prompt.parsed
        prompt.span.activate()  # this prompt's log lines carry its ids
        assembling_ns = time.time_ns()
        if request.request_id in state.recorded:
            # Answered and recorded already: a prompt read again after a restart or a rebalance (its
            # batch was served but not committed). Serving it again would put its own turn into its
            # context and answer it twice; its answer went to its reply address the first time.
            self.repeats += 1
            log.info("conversation %s: request %s was answered already (a redelivered prompt); not served again",
                     request.conversation_id, request.request_id)
            return None
        if not await self._choose_model(prompt, state, outbox):
            return None
        if parsed.raw:
            return await self._prepare_raw(prompt, state, outbox, assembling_ns)
        if parsed.history:  # the client keeps its own history (OpenAI style): it replaces the table's
            recent = [Segment((m,), order=i) for i, m in enumerate(parsed.history)]
        else:
            recent = [Segment.turn(t.prompt, t.answer, t.created_at, t.turn_id) for t in state.recent]
        recalled = [Segment.turn(h.turn.prompt, h.turn.answer, h.turn.created_at, h.turn.turn_id) for h in hits]
        system_prompt = parsed.system_prompt or self.settings.system_prompt
        budget = self.settings.context_tokens - request.sampling.max_tokens
        try:
            context = assemble_context(system_prompt=system_prompt, prompt=parsed.prompt, recent=recent,
                                       recalled=recalled, budget=budget, counter=self.services.counter)
        except PromptTooLongError as exc:
            await self.refusals.refuse(prompt.message, request, exc, "context_length_exceeded", outbox)
            return None
        except ChatTemplateError as exc:  # the model's template refused the messages: the prompt's fault
            await self.refusals.refuse(prompt.message, request, InvalidPromptError(str(exc)), "invalid_request",
                                       outbox)
            return None
        if await self._refused_for_load(prompt, context.tokens, outbox):
            return None
        memory_degraded = memory_degraded and request.memory
        pending = PendingRequest(request.request_id, parsed.prompt, parsed.system_prompt, request.created_at,
                                 memory_degraded=memory_degraded, remember=request.memory)
        return self._request(prompt, state, pending, assembling_ns,
                             {"chatpipe.context.messages": len(context.messages),
                              "chatpipe.context.recalled_turns": len(context.recalled_turn_ids)},
                             messages=context.messages, context_tokens=context.tokens,
                             recalled_turn_ids=context.recalled_turn_ids, memory_degraded=memory_degraded)

    async def _prepare_raw(self, prompt: _Prompt, state: ConversationState, outbox: Outbox,
                           assembling_ns: int) -> InferenceRequest | None:
        """A raw prompt (v5 ``raw_prompt``): passed through as it is, no system prompt, no history, no
        recall; within the budget or refused as context_length_exceeded (the worker counts exactly:
        it may add the tokenizer's BOS). Pending like a chat prompt, so its response is recorded as
        the conversation's turn, but not remembered (``PendingRequest.remember``)."""
        request, text = prompt.request, prompt.parsed.prompt
        budget = self.settings.context_tokens - request.sampling.max_tokens
        tokens = self.services.counter.text_tokens([text])[0]
        if tokens > budget:
            exc = PromptTooLongError(f"the raw prompt takes {tokens} tokens, more than the budget of {budget} "
                                     "(context window minus the request's max_tokens)")
            await self.refusals.refuse(prompt.message, request, exc, "context_length_exceeded", outbox)
            return None
        if await self._refused_for_load(prompt, tokens, outbox):
            return None
        pending = PendingRequest(request.request_id, text, None, request.created_at, remember=False)
        return self._request(prompt, state, pending, assembling_ns,
                             {"chatpipe.context.messages": 0, "chatpipe.context.raw": True},
                             messages=[], context_tokens=tokens, raw_prompt=text)

    async def _choose_model(self, prompt: _Prompt, state: ConversationState, outbox: Outbox) -> bool:
        """The exact model that answers (a base model or ``name@version``): the conversation keeps the
        version it was answered by while that version is served; a new one may land in a canary
        (``model_catalog.choose_model``). Kept in ``state`` with the request; False when refused (a
        version retired or forbidden since the gateway checked it: dead letter and error chunk)."""
        request = prompt.request
        if self.models is None:
            prompt.model = request.model
            return True
        try:
            prompt.model = self.models.choose(request.model, request.tenant, state.key, (request.model,),
                                              pinned=state.model_version)
        except ModelChoiceError as exc:
            await self.refusals.refuse(prompt.message, request, exc, exc.code, outbox)
            prompt.span.set("chatpipe.outcome", exc.code)
            return False
        if prompt.model != state.model_version:
            if state.model_version is not None:
                log.info("conversation %s: model %s -> %s (%s is no longer served)", request.conversation_id,
                         state.model_version, prompt.model, state.model_version)
            state.model_version = prompt.model
        prompt.span.set("gen_ai.request.model", prompt.model)
        return True

    async def _refused_for_load(self, prompt: _Prompt, prompt_tokens: int, outbox: Outbox) -> bool:
        """Refuse ``prompt`` (True) when the fleet's measured estimate of its first token is past its
        ``deadline_at``; the answer says when a retry would fit."""
        request = prompt.request
        if self.fleet is None or request.deadline_at is None:
            return False
        estimate = self.fleet.estimate(request.model, Work(), prompt_tokens)
        if estimate is None or not estimate.measured:
            return False
        shortfall = deadline_shortfall(estimate, request.deadline_at, now_ms())
        if shortfall is None:
            return False
        exc = DeadlineUnreachableError(shortfall.reason)
        self.unreachable += 1
        await self.refusals.refuse(prompt.message, request, exc, "deadline_unreachable", outbox,
                                   finish=FinishReason.OVERLOADED)
        prompt.span.set("chatpipe.outcome", "deadline_unreachable")
        return True

    def _request(self, prompt: _Prompt, state: ConversationState, pending: PendingRequest, assembling_ns: int,
                 assembled: dict[str, Any], **context: Any) -> InferenceRequest:
        """The prompt's ``InferenceRequest`` with its assembled ``context`` (``InferenceRequest`` fields),
        its "assemble" span (``assembled``: attributes of the context) and its pending entry in ``state``."""
        request = prompt.request
        self.metrics.assembled_tokens.observe(context["context_tokens"])
        prompt.span.child("assemble", start_ns=assembling_ns, attributes={
            "chatpipe.context.tokens": context["context_tokens"], **assembled,
            "gen_ai.request.max_tokens": request.sampling.max_tokens}).end()
        out = InferenceRequest(
            request_id=request.request_id, conversation_id=request.conversation_id, user_id=request.user_id,
            tenant=request.tenant, created_at=request.created_at, model=prompt.model, sampling=request.sampling,
            priority=request.priority, reply_to=request.reply_to, reply_partition=request.reply_partition,
            deadline_at=request.deadline_at, share_weight=request.share_weight, **context,
        )
        if self.cache is not None and (key := self.cache.key_for(request, out)) is not None:
            self._cache_keys[out.request_id] = key
            pending.cache_key = key.digest  # a miss's answer is stored under it by the record agent
        evicted = state.add_pending(pending, self.settings.pending_limit)
        if evicted is not None:
            log.warning("conversation %s: no response for request %s among the last %d; forgetting it",
                        request.conversation_id, evicted.request_id, self.settings.pending_limit)
        return out

    async def _send(self, prompt: _Prompt, out: InferenceRequest, outbox: Outbox) -> None:
        # Handed to the producer here; the batch is acked only after outbox.deliver(), so a prompt
        # is never committed as served before its request is on the broker.
        topic = self.out_topics[inference_requests_topic(out.priority)]
        await outbox.send(topic, key=out.conversation_id.encode(), value=self.services.codec.encode(out),
                          parent_trace=prompt.span.traceparent)
        self.served += 1
