"""The record agent: ``chat.responses`` -> conversation state, ``chat.turns`` and memory.

Per batch of responses (adaptive like intake's, ``batching``: a lone response is recorded at
once, since a follow-up of its conversation may be waiting for it, ``recorded.py``): join each
with its pending request (kept in the conversation's state by intake), drop a response whose request id was already recorded (a response delivered twice
makes one turn), send a ``ConversationTurn`` per response to ``chat.turns``, and only once the
broker has them write the conversation states back to the table (under the state lock again, onto
each state as it is then: intake may have added a pending request meanwhile).

Memory is not written here: a turn says whether memory keeps it (ConversationTurn v4
``remembered``), and the memory writer embeds and upserts it from ``chat.turns``
(``memory_writer.py``): the topic is the durable outbox of memory's writes, so a slow or stopped
Qdrant delays memory, never a turn, and no network call waits under the state lock.

That order makes a crash or a failed delivery anywhere in between safe: the redelivered
responses find the state as it was (the request still pending, not "recorded") and produce the
same turns again, and the turn id is derived from the request id (uuid5), so the ``chat.turns``
record (same ``event_id``) and the memory point made from it are repeats of the same facts.
Had the state been written first, a delivery that failed would have left it saying "recorded"
and the redelivered response would be skipped as a duplicate: a turn never on ``chat.turns``, in
the archive or the datasets. The batch is acked only after every turn and dead letter is on the
broker; a broker fault is retried, and past the retry budget the batch stays unacked and the
process exits (``faults.py``).

A response to a request that missed the response cache (its pending entry has the cache key) and ended
STOP or LENGTH is stored in the cache once its turn is on the broker, outside the state lock
(``response_cache.py``); a Redis that refuses costs a later miss, nothing else. A response answered from
the cache (``response_cached``, ``cache_answers.py``) is recorded like any other.

A request with ``n`` > 1 choices is answered by n Responses (v2 ``choice_index``); its turn is
choice 0's, the others are skipped (counted in ``other_choices``): a conversation has one history,
and the turn the next prompt continues from is the first choice, as OpenAI clients show it.

Answers that failed (ERROR, TIMEOUT, OVERLOADED, CANCELLED) are emitted as turns for analytics
but neither remembered nor put in the recent window; so are answers to raw prompts (PromptRequest
v5 ``raw_prompt``, POST /v1/completions: ``PendingRequest.remember`` false).

A response to a prompt made at or before a ``Deletion`` of its user or conversation (it was in
flight while the user was forgotten, or intake took the prompt after the forget) is dropped:
no turn, no memory, no dead letter (which would copy its text to ``chat.dlq``); its pending
request leaves the state, and a state left with nothing goes (``streams/erasures.py``).

No Faust here: ``Record.handle`` takes the batch's messages and an outbox (``streams/ports.py``); the
Faust agent that feeds it is ``faust_runtime.agents.faust_agent``. Tests without Faust:
tests/streams/test_agent_logic.py.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from schemas.errors import DecodeError
from schemas.records import ConversationTurn, FinishReason, Response, now_ms
from streams.dead_letters import DeadLetters, event_headers, receive_batch
from streams.erasures import ErasureRegistry
from streams.errors import UnknownRequestError
from streams.ports import BatchRule, Message, Outbox
from streams.recorded import RecordedOffsets
from streams.response_cache import CACHED, CacheKey, CachedAnswer, ResponseCache
from streams.services import StreamsServices
from streams.settings import StreamsSettings
from streams.state import ConversationState, RecentTurn, state_key
from transport import tracing
from transport.spans import Span, deactivate

log = logging.getLogger(__name__)

REMEMBERED = (FinishReason.STOP, FinishReason.LENGTH)
_TURN_NAMESPACE = uuid.UUID("6f1c3a52-7d0e-4f5b-9a57-3c2d1e0b8a41")


@dataclass(frozen=True, slots=True)
class StateChange:
    """What one response does to its conversation's state: its pending request leaves, and if
    ``recorded`` it counts as a turn (``recent`` None: not remembered)."""

    key: str
    request_id: str
    recorded: bool = False
    recent: RecentTurn | None = None
    tokens_in: int = 0
    tokens_out: int = 0

    def apply(self, state: ConversationState, settings: StreamsSettings) -> int | None:
        """Applies the change to ``state``; the turn's index when it is recorded (once: a request
        already recorded stays as it is)."""
        state.take_pending(self.request_id)
        if not self.recorded or state.was_recorded(self.request_id):
            return None
        return state.record(self.request_id, self.recent, tokens_in=self.tokens_in, tokens_out=self.tokens_out,
                            window=settings.recent_turns, dedupe_window=settings.dedupe_window)


def turn_id_for(request_id: str) -> str:
    """The turn id (ConversationTurn.event_id, Qdrant point) of a request: the same on every retry."""
    return uuid.uuid5(_TURN_NAMESPACE, request_id).hex


class Record:
    def __init__(self, settings: StreamsSettings, services: StreamsServices, table: Any, turns_topic: Any,
                 dead_letters: DeadLetters, erasures: ErasureRegistry | None = None,
                 recorded: RecordedOffsets | None = None, cache: ResponseCache | None = None) -> None:
        self.settings = settings
        self.cache = cache  # the response cache a miss's answer is stored in (response_cache.py); None: none
        self.batching = BatchRule(settings.record_batch_size, settings.record_batch_window_s,
                                  settings.record_batch_idle_s)
        self.recorded_offsets = recorded  # what intake waits on for a follow-up (recorded.py)
        self.erasures = erasures if erasures is not None else ErasureRegistry()
        self.erased = 0  # responses dropped because a deletion erased their user or conversation
        self.services = services
        self.table = table
        self.turns_topic = turns_topic
        self.dead_letters = dead_letters
        self.recorded = 0
        self.duplicates = 0
        self.other_choices = 0  # Responses of choices other than 0 (n > 1): not turns

    async def handle(self, messages: Sequence[Message], outbox: Outbox) -> None:
        """Record every response of ``messages``; returns once all they produced is durable."""
        tracer = self.services.tracer
        start_ns = receive_batch(tracer, self.settings.app_id, messages)
        spans: list[Span] = []  # one "process chat.responses" per response, ended once its turn is durable
        to_cache: list[tuple[CacheKey, CachedAnswer]] = []
        async with self.services.state_lock:
            changes = await self._handle_locked(messages, outbox, spans, start_ns, to_cache)
        await outbox.deliver()  # a delivery that fails raises here: no state says "recorded" yet
        async with self.services.state_lock:
            self._write_states(changes)
            if self.recorded_offsets is not None:  # the table holds these responses' effects now
                for m in messages:
                    self.recorded_offsets.applied(m.partition, m.offset)
        if to_cache and self.cache is not None:  # outside the lock; a store Redis refuses is only a later miss
            await self.cache.store(to_cache)
        for span in spans:
            span.end()
        deactivate()

    async def _handle_locked(self, messages: Sequence[Message], outbox: Outbox, spans: list[Span],
                             start_ns: int, to_cache: list[tuple[CacheKey, CachedAnswer]]) -> list[StateChange]:
        """Decode, join and send each turn; returns what the conversation states will say once the
        turns are delivered (``_write_states``). The states here are copies. Answers the response cache
        should keep (a miss's, ended STOP or LENGTH) are added to ``to_cache``."""
        services, settings = self.services, self.settings
        states: dict[str, ConversationState] = {}
        changes: list[StateChange] = []
        turns: list[tuple[ConversationTurn, Span]] = []
        for m in messages:
            try:
                response = services.codec.decode(m.value, Response, topic=m.topic, partition=m.partition,
                                                 offset=m.offset)
            except DecodeError as exc:
                await self.dead_letters.send(m, exc, outbox)
                continue
            span = services.tracer.process(m.topic, tracing.find(event_headers(m)), group=settings.app_id,
                                           partition=m.partition, offset=m.offset, start_ns=start_ns,
                                           attributes={"chatpipe.request_id": response.request_id}).activate()
            spans.append(span)
            if response.choice_index != 0:  # n > 1: the turn is choice 0's (module docstring)
                self.other_choices += 1
                span.set("chatpipe.outcome", "other_choice")
                continue
            key = state_key(response.tenant, response.user_id, response.conversation_id)
            if key not in states:
                value = self.table.get(key)
                if value is not None:
                    states[key] = ConversationState.from_value(value)
            state = states.get(key)
            if state is not None and state.was_recorded(response.request_id):
                self.duplicates += 1
                span.set("chatpipe.outcome", "duplicate")
                log.info("response %s delivered again; already recorded", response.request_id)
                continue
            pending = state.take_pending(response.request_id) if state is not None else None
            if pending is None:
                span.set("chatpipe.outcome", "dead_letter")
                await self.dead_letters.send(m, UnknownRequestError(
                    f"response {response.request_id} of conversation {response.conversation_id}: no pending "
                    "request (never seen by intake, or the conversation was forgotten meanwhile)"), outbox)
                continue
            if self.erasures.erased(response.tenant, response.user_id, response.conversation_id,
                                    pending.created_at):
                self.erased += 1
                span.set("chatpipe.outcome", "erased")
                log.info("response %s: its prompt predates a deletion of %s/%s; not recorded", response.request_id,
                         response.tenant, response.user_id)
                changes.append(StateChange(key, response.request_id))  # its pending request goes, no turn
                continue
            turn_id = turn_id_for(response.request_id)
            remembered = response.finish_reason in REMEMBERED and pending.remember  # a raw prompt's: never
            recent = RecentTurn(turn_id, state.turn_count, pending.prompt, response.text, pending.created_at)
            change = StateChange(key, response.request_id, recorded=True, recent=recent if remembered else None,
                                 tokens_in=response.tokens_in, tokens_out=response.tokens_out)
            changes.append(change)
            index = change.apply(state, settings)
            turn = ConversationTurn(
                event_id=turn_id, conversation_id=response.conversation_id, user_id=response.user_id,
                tenant=response.tenant, request_id=response.request_id, turn_index=index,
                system_prompt=pending.system_prompt, prompt=pending.prompt, answer=response.text,
                model=response.model, worker_id=response.worker_id, tokens_in=response.tokens_in,
                tokens_out=response.tokens_out, queue_ms=response.queue_ms, ttft_ms=response.ttft_ms,
                total_ms=response.total_ms, finish_reason=response.finish_reason,
                created_at=pending.created_at, completed_at=response.completed_at,
                trace_id=span.trace_id,  # lineage: the turn, its archive row and dataset rows lead to this trace
                remembered=remembered, memory_degraded=pending.memory_degraded,
                cached_tokens=response.cached_tokens, response_cached=response.response_cached,
            )
            span.set("chatpipe.outcome", "recorded")
            turns.append((turn, span))
            if pending.cache_key and not response.response_cached and response.finish_reason in CACHED:
                to_cache.append((CacheKey(response.tenant, pending.cache_key, response.model), CachedAnswer(
                    text=response.text, finish_reason=str(response.finish_reason), tokens_in=response.tokens_in,
                    tokens_out=response.tokens_out, model=response.model, tenant=response.tenant,
                    user_id=response.user_id, conversation_id=response.conversation_id,
                    created_at=pending.created_at, request_id=response.request_id, stored_at=now_ms())))
        for turn, span in turns:
            await outbox.send(self.turns_topic, key=turn.conversation_id.encode(), value=services.codec.encode(turn),
                              parent_trace=span.traceparent)
        self.recorded += len(turns)
        return changes

    def _write_states(self, changes: list[StateChange]) -> None:
        """The batch's changes applied to each conversation's state as it is now, after its turns are on
        the broker: intake may have added a pending request since the copies were read, and forget
        may have removed the conversation (then nothing of it is written back)."""
        by_key: dict[str, list[StateChange]] = {}
        for change in changes:
            by_key.setdefault(change.key, []).append(change)
        for key, key_changes in by_key.items():
            value = self.table.get(key)
            if value is None:  # forgotten meanwhile (streams/forget.py)
                continue
            state = ConversationState.from_value(value)
            for change in key_changes:
                change.apply(state, self.settings)
            if state.turn_count == 0 and not state.pending and not state.recent:
                del self.table[key]  # only an erased prompt had made it: nothing of the user stays
                continue
            self.table[key] = state.to_value()
