"""The agents' logic without Faust (streams/ports.py): a batch of consumed records in, records out.

Real records (``schemas.records``) and the real codec on every input and output; the conversation
table is a ``dict``, the outbox a list. Faked, and only these: the broker (``FakeOutbox`` keeps what
would be produced; ``FakeReplies`` the embeddings' reply producer), memory and the embedding model
(``FakeMemory``/``FakeEmbedder``: fixed vectors, no Qdrant; memory itself is tests/streams/test_memory.py),
and for the adapter tests Faust's stream (``FakeStream``). Tokens are counted one per word.
"""

from __future__ import annotations

import asyncio
import math
import re
import subprocess
import sys
from collections import namedtuple
from dataclasses import dataclass, field

import numpy as np
import pytest

from schemas.codec import default_codec
from schemas.records import (
    ChatMessage,
    ConversationTurn,
    DeadLetter,
    EmbeddingRequest,
    EmbeddingResult,
    FinishReason,
    InferenceRequest,
    Priority,
    PromptRequest,
    Response,
    SamplingParams,
)
from schemas.topics import INFERENCE_REQUESTS, INFERENCE_REQUESTS_BATCH, PROMPTS, RESPONSES
from streams.dead_letters import DeadLetters
from streams.embedding_requests import DEFAULT_MODEL_NAME, EmbeddingRequests
from streams.faults import Retrier
from streams.intake import Intake
from streams.record import Record, turn_id_for
from streams.refusals import Refusals
from streams.services import StreamsServices
from streams.settings import StreamsSettings
from streams.state import ConversationState, state_key
from streams.tokens import TokenCounter
from transport.fleet import RETRY_MARGIN

CODEC = default_codec()
TP = namedtuple("TP", "topic partition")


@dataclass
class Msg:
    """A consumed record as the agents read it (streams.ports.Message)."""

    topic: str
    offset: int
    value: bytes
    key: bytes | None = None
    partition: int = 0
    headers: list = field(default_factory=list)
    timestamp: float = 0.0

    @property
    def tp(self):
        return TP(self.topic, self.partition)


class Topic:
    def __init__(self, name: str) -> None:
        self.name = name

    def get_topic_name(self) -> str:
        return self.name


class FakeOutbox:
    """The broker, faked: what the agent sends, by topic name."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes | None, bytes]] = []
        self.delivered = 0

    async def send(self, topic, *, key, value, headers=None, partition=None, parent_trace=None) -> None:
        self.sent.append((topic.get_topic_name(), key, value))

    async def deliver(self) -> None:
        self.delivered += 1

    def records(self, topic: str) -> list:
        return [CODEC.decode(value) for name, _, value in self.sent if name == topic]


class FakeEmbedder:
    dim = 4
    path = None  # the default model's served name

    async def aencode(self, texts, reuse=False):
        return np.ones((len(texts), self.dim), dtype="float32") / 2


class FakeMemory:
    def __init__(self) -> None:
        self.upserts: list = []

    def recall_many(self, queries):
        return [[] for _ in queries]

    def upsert(self, turns, vectors):
        self.upserts.extend(turns)


def services() -> StreamsServices:
    return StreamsServices(memory=FakeMemory(), embedder=FakeEmbedder(), counter=TokenCounter(lambda t: t.split()))


def settings() -> StreamsSettings:
    return StreamsSettings(app_id="test", system_prompt="be brief", context_tokens=512)


RETRIER = Retrier(1, 0.01, 0.01)


def intake(table: dict) -> Intake:
    letters = DeadLetters(Topic("chat.dlq"), CODEC, "streams.intake")
    topics = {INFERENCE_REQUESTS: Topic(INFERENCE_REQUESTS), INFERENCE_REQUESTS_BATCH: Topic(INFERENCE_REQUESTS_BATCH)}
    return Intake(settings(), services(), table, topics, letters, Refusals(letters, RETRIER, None, None), RETRIER)


def record(table: dict, svc: StreamsServices | None = None) -> Record:
    return Record(settings(), svc or services(), table, Topic("chat.turns"),
                  DeadLetters(Topic("chat.dlq"), CODEC, "streams.record"))


def prompt(text: str, conversation: str = "c1", **kw) -> PromptRequest:
    return PromptRequest(conversation_id=conversation, user_id="ada", tenant="acme", model="smollm2",
                         messages=[ChatMessage("user", text)], sampling=SamplingParams(max_tokens=64), **kw)


def response(request: InferenceRequest, text: str = "Paris.") -> Response:
    return Response(request_id=request.request_id, conversation_id=request.conversation_id, user_id=request.user_id,
                    tenant=request.tenant, text=text, model="smollm2", worker_id="w1", tokens_in=10, tokens_out=2,
                    queue_ms=1, ttft_ms=2, total_ms=3, finish_reason=FinishReason.STOP, created_at=request.created_at)


def messages(topic: str, *values: bytes) -> list[Msg]:
    return [Msg(topic, offset, value) for offset, value in enumerate(values)]


# --- intake ---------------------------------------------------------------------------------------


def test_intake_serves_each_prompt_to_its_prioritys_topic_and_dead_letters_what_does_not_decode():
    table: dict = {}
    agent, out = intake(table), FakeOutbox()
    first = prompt("What is the capital of France?", share_weight=2.5)
    batch = prompt("Summarise this.", "c2", priority=Priority.BATCH)
    asyncio.run(agent.handle(messages(PROMPTS, CODEC.encode(first), b"\xc3\x01not a record", CODEC.encode(batch)),
                             out))
    (served,) = out.records(INFERENCE_REQUESTS)
    assert isinstance(served, InferenceRequest) and served.request_id == first.request_id
    assert [m.content for m in served.messages] == ["be brief", "What is the capital of France?"]
    assert served.context_tokens == 8 and served.reply_to is None
    assert served.share_weight == 2.5  # the tenant's weight in the worker's fair share, carried over
    assert [r.request_id for r in out.records(INFERENCE_REQUESTS_BATCH)] == [batch.request_id]
    (letter,) = out.records("chat.dlq")
    assert isinstance(letter, DeadLetter) and letter.error_type == "UnknownSchemaError" and letter.source_offset == 1
    state = ConversationState.from_value(table[state_key("acme", "ada", "c1")])
    assert [p.request_id for p in state.pending] == [first.request_id], "pending before its request is produced"
    assert out.delivered == 1 and agent.served == 2


def test_intake_refuses_a_prompt_over_the_budget_and_does_not_serve_one_answered_already():
    table: dict = {}
    agent, out = intake(table), FakeOutbox()
    too_long = prompt("word " * 600)
    asyncio.run(agent.handle(messages(PROMPTS, CODEC.encode(too_long)), out))
    (letter,) = out.records("chat.dlq")
    assert letter.error_type == "PromptTooLongError" and not out.records(INFERENCE_REQUESTS)
    # a prompt read again after its answer was recorded (a redelivery after a restart)
    again = prompt("hello")
    state = ConversationState("acme", "ada", "c1")
    state.recorded.append(again.request_id)
    table[state.key] = state.to_value()
    out = FakeOutbox()
    asyncio.run(agent.handle(messages(PROMPTS, CODEC.encode(again)), out))
    assert not out.sent and agent.repeats == 1


# --- record ---------------------------------------------------------------------------------------


@pytest.mark.model
def test_intake_refuses_a_prompt_the_chat_template_refuses():
    """With the real tokenizer and a template that refuses two user messages in a row (as Llama 2's and
    Mistral's do), a client-kept history of two user turns made the template raise inside intake's
    context budget: the agent failed and streams crash-looped on the record. It is the prompt's fault:
    a dead letter with the template's reason and an error chunk, and intake serves the next prompt."""
    import copy

    from inference.engine.model_store import locate_model
    from inference.engine.settings import EngineSettings
    from streams.tokens import load_chat_tokenizer
    from tests.worker.test_prompts_and_dedupe import ALTERNATING_TEMPLATE

    strict = copy.deepcopy(load_chat_tokenizer(locate_model(EngineSettings()).folder))
    strict.chat_template = ALTERNATING_TEMPLATE
    svc = StreamsServices(memory=FakeMemory(), embedder=FakeEmbedder(), counter=TokenCounter.for_tokenizer(strict))
    letters = DeadLetters(Topic("chat.dlq"), CODEC, "streams.intake")
    topics = {INFERENCE_REQUESTS: Topic(INFERENCE_REQUESTS), INFERENCE_REQUESTS_BATCH: Topic(INFERENCE_REQUESTS_BATCH)}
    agent = Intake(settings(), svc, {}, topics, letters, Refusals(letters, RETRIER, None, None), RETRIER)
    two_users = PromptRequest(conversation_id="c2", user_id="ada", tenant="acme", model="smollm2",
                              messages=[ChatMessage("user", "hi"), ChatMessage("user", "hello again")],
                              sampling=SamplingParams(max_tokens=64))
    out = FakeOutbox()
    asyncio.run(agent.handle(messages(PROMPTS, CODEC.encode(two_users), CODEC.encode(prompt("hi", "c3"))), out))
    (letter,) = out.records("chat.dlq")
    assert letter.error_type == "InvalidPromptError" and "roles must alternate" in letter.error_message
    (served,) = out.records(INFERENCE_REQUESTS)
    assert served.conversation_id == "c3"


def test_record_turns_an_answer_into_one_turn_that_memory_keeps_once():
    table: dict = {}
    out = FakeOutbox()
    asyncio.run(intake(table).handle(messages(PROMPTS, CODEC.encode(prompt("What is the capital of France?"))), out))
    (request,) = out.records(INFERENCE_REQUESTS)
    svc = services()
    agent, turns = record(table, svc), FakeOutbox()
    answer = CODEC.encode(response(request))
    asyncio.run(agent.handle(messages(RESPONSES, answer, answer), turns))  # delivered twice in one batch
    (turn,) = turns.records("chat.turns")
    assert isinstance(turn, ConversationTurn) and turn.event_id == turn_id_for(request.request_id)
    assert (turn.prompt, turn.answer, turn.turn_index) == ("What is the capital of France?", "Paris.", 0)
    # memory is written from chat.turns by the memory writer (memory_writer.py), not by record
    assert turn.remembered and not turn.memory_degraded and svc.memory.upserts == []
    state = ConversationState.from_value(table[state_key("acme", "ada", "c1")])
    assert not state.pending and [t.answer for t in state.recent] == ["Paris."] and agent.duplicates == 1
    # the next prompt's context holds the answer
    out = FakeOutbox()
    asyncio.run(intake(table).handle(messages(PROMPTS, CODEC.encode(prompt("And of Spain?"))), out))
    (follow_up,) = out.records(INFERENCE_REQUESTS)
    assert [m.content for m in follow_up.messages][1:] == ["What is the capital of France?", "Paris.", "And of Spain?"]


def test_a_failed_answer_is_a_turn_memory_does_not_keep():
    table: dict = {}
    out = FakeOutbox()
    asyncio.run(intake(table).handle(messages(PROMPTS, CODEC.encode(prompt("What is the capital of France?"))), out))
    (request,) = out.records(INFERENCE_REQUESTS)
    failed = response(request, text="")
    failed.finish_reason = FinishReason.ERROR
    turns = FakeOutbox()
    asyncio.run(record(table).handle(messages(RESPONSES, CODEC.encode(failed)), turns))
    (turn,) = turns.records("chat.turns")
    assert not turn.remembered


class StoppedMemory(FakeMemory):
    """Memory that does not answer (a Qdrant server SIGSTOPped, faked: the real one is tests/faults) until
    ``release`` is set, or that refuses at once like a server away (``error``)."""

    def __init__(self, error: Exception | None = None) -> None:
        super().__init__()
        import threading

        self.release, self.error, self.calls = threading.Event(), error, 0

    def recall_many(self, queries):
        self.calls += 1
        if self.error is not None:
            raise self.error
        self.release.wait(10)
        return super().recall_many(queries)


@pytest.mark.parametrize("away", ["hung", "refusing"])
def test_a_prompt_is_served_with_its_recent_turns_when_memory_does_not_answer(away):
    """Intake used to retry recall for up to retry_budget_s (60 s), under the lock every agent takes: a
    slow Qdrant stopped every prompt. Now recall has recall_timeout_s; past it the prompt is served with
    its recent turns only, marked memory_degraded on the request, and its turn says so too."""
    import httpx

    table: dict = {}
    out = FakeOutbox()
    asyncio.run(intake(table).handle(messages(PROMPTS, CODEC.encode(prompt("What is the capital of France?"))), out))
    (first,) = out.records(INFERENCE_REQUESTS)
    asyncio.run(record(table).handle(messages(RESPONSES, CODEC.encode(response(first))), FakeOutbox()))

    memory = StoppedMemory(httpx.ConnectError("connection refused") if away == "refusing" else None)
    svc = StreamsServices(memory=memory, embedder=FakeEmbedder(), counter=TokenCounter(lambda t: t.split()))
    letters = DeadLetters(Topic("chat.dlq"), CODEC, "streams.intake")
    topics = {INFERENCE_REQUESTS: Topic(INFERENCE_REQUESTS), INFERENCE_REQUESTS_BATCH: Topic(INFERENCE_REQUESTS_BATCH)}
    agent = Intake(settings().model_copy(update={"recall_timeout_s": 0.3}), svc, table, topics, letters,
                   Refusals(letters, RETRIER, None, None), RETRIER)
    out = FakeOutbox()
    started = asyncio.run(_timed(agent.handle(messages(PROMPTS, CODEC.encode(prompt("And of Spain?"))), out)))
    memory.release.set()
    (follow_up,) = out.records(INFERENCE_REQUESTS)
    assert started < 3, f"intake waited {started:.1f} s for memory"
    assert follow_up.memory_degraded and agent.memory_degraded == 1 and memory.calls >= 1
    assert [m.content for m in follow_up.messages][1:] == ["What is the capital of France?", "Paris.", "And of Spain?"]
    turns = FakeOutbox()
    asyncio.run(record(table).handle(messages(RESPONSES, CODEC.encode(response(follow_up, "Madrid."))), turns))
    assert turns.records("chat.turns")[0].memory_degraded


async def _timed(coroutine) -> float:
    import time

    started = time.monotonic()
    await coroutine
    return time.monotonic() - started


def test_a_bug_in_recall_is_raised_not_hidden_as_a_degraded_context():
    table: dict = {}
    memory = StoppedMemory(KeyError("a bug"))
    svc = StreamsServices(memory=memory, embedder=FakeEmbedder(), counter=TokenCounter(lambda t: t.split()))
    letters = DeadLetters(Topic("chat.dlq"), CODEC, "streams.intake")
    topics = {INFERENCE_REQUESTS: Topic(INFERENCE_REQUESTS), INFERENCE_REQUESTS_BATCH: Topic(INFERENCE_REQUESTS_BATCH)}
    agent = Intake(settings(), svc, table, topics, letters, Refusals(letters, RETRIER, None, None), RETRIER)
    with pytest.raises(KeyError):
        asyncio.run(agent.handle(messages(PROMPTS, CODEC.encode(prompt("hi"))), FakeOutbox()))


def test_a_prompt_straight_to_chat_prompts_whose_deadline_the_fleet_cannot_meet_is_refused_at_once():
    """A producer without a gateway had no admission: a prompt whose deadline the workers could not meet
    waited in the queue to expire. Intake now asks the gateway's estimate (transport/fleet.py) from the
    workers' reports: past the deadline, refused at once with when to retry; in time or without a deadline,
    served; and a fleet that has measured nothing refuses nothing."""
    from schemas.records import WorkerState, WorkerStatus, now_ms
    from transport.fleet import Fleet

    fleet = Fleet(stale_s=30)
    agent = intake({})
    agent.fleet = fleet
    out = FakeOutbox()
    soon = prompt("What is the capital of France?", "c1", deadline_at=now_ms() + 5_000)
    asyncio.run(agent.handle(messages(PROMPTS, CODEC.encode(soon)), out))
    assert [r.request_id for r in out.records(INFERENCE_REQUESTS)] == [soon.request_id]  # nothing measured yet

    # one worker, its batch of 4 full, 1,200 output tokens ahead at 10 tokens/s: ~120 s to a free slot
    fleet.update(WorkerStatus(worker_id="w1", model="smollm2", state=WorkerState.SERVING, running=4, waiting=10,
                              kv_cache_used_tokens=0, kv_cache_total_tokens=4096, tokens_per_s=10.0, max_running=4,
                              queued_output_tokens=1_000, running_output_tokens=200, decode_tokens_per_s=10.0,
                              prefill_tokens_per_s=1_000.0))
    out = FakeOutbox()
    late = prompt("And of Spain?", "c2", deadline_at=now_ms() + 5_000)
    in_time = prompt("And of Italy?", "c3", deadline_at=now_ms() + 600_000)
    no_deadline = prompt("And of Peru?", "c4")
    asyncio.run(agent.handle(messages(PROMPTS, *(CODEC.encode(p) for p in (late, in_time, no_deadline))), out))
    assert {r.request_id for r in out.records(INFERENCE_REQUESTS)} == {in_time.request_id, no_deadline.request_id}
    (letter,) = out.records("chat.dlq")
    assert letter.error_type == "DeadlineUnreachableError"
    # the excess (120 s wait against 5 s left: ~115 s) plus the margin for a moving rate (20% of 120 s)
    retry = int(re.search(r"retry after (\d+) s", letter.error_message).group(1))
    assert retry == math.ceil(115 + RETRY_MARGIN * 120) or retry == math.ceil(115 + RETRY_MARGIN * 120) + 1, retry
    assert agent.unreachable == 1


class FailingOutbox(FakeOutbox):
    """A broker that takes the records and then does not acknowledge them (a delivery timeout)."""

    async def deliver(self) -> None:
        from transport.errors import DeliveryError

        raise DeliveryError("chat.turns: Local: Message timed out")


def test_record_writes_the_state_only_after_the_turn_is_delivered():
    """Record used to write "recorded" into the conversation's state before its turn's produce was
    confirmed: a delivery that failed ended the process, and the response read again after the restart
    was skipped as a duplicate, so the turn never reached chat.turns, the archive or the datasets.
    Now a failed delivery leaves the state as it was, and the response read again makes its turn."""
    from transport.errors import DeliveryError

    table: dict = {}
    out = FakeOutbox()
    asyncio.run(intake(table).handle(messages(PROMPTS, CODEC.encode(prompt("What is the capital of France?"))), out))
    (request,) = out.records(INFERENCE_REQUESTS)
    key = state_key("acme", "ada", "c1")
    before = dict(table[key])
    answer = messages(RESPONSES, CODEC.encode(response(request)))

    with pytest.raises(DeliveryError):
        asyncio.run(record(table).handle(answer, FailingOutbox()))
    assert table[key] == before, "a turn not delivered must not be in the state"

    again = FakeOutbox()  # the restarted process reads the same response
    asyncio.run(record(table).handle(answer, again))
    (turn,) = again.records("chat.turns")
    assert turn.event_id == turn_id_for(request.request_id) and turn.answer == "Paris."
    state = ConversationState.from_value(table[key])
    assert state.was_recorded(request.request_id) and not state.pending and state.turn_count == 1


def test_record_keeps_a_prompt_intake_added_while_its_turns_were_delivered():
    """The state is written after delivery onto the state as it is then, not the copy read before: a
    follow-up's pending request that intake added meanwhile stays."""
    table: dict = {}
    out = FakeOutbox()
    asyncio.run(intake(table).handle(messages(PROMPTS, CODEC.encode(prompt("What is the capital of France?"))), out))
    (request,) = out.records(INFERENCE_REQUESTS)

    class IntakeDuringDelivery(FakeOutbox):
        async def deliver(self) -> None:
            follow_up = messages(PROMPTS, CODEC.encode(prompt("And of Spain?")))
            await intake(table).handle(follow_up, FakeOutbox())

    asyncio.run(record(table).handle(messages(RESPONSES, CODEC.encode(response(request))), IntakeDuringDelivery()))
    state = ConversationState.from_value(table[state_key("acme", "ada", "c1")])
    assert state.was_recorded(request.request_id) and [t.answer for t in state.recent] == ["Paris."]
    assert [p.prompt for p in state.pending] == ["And of Spain?"]


def test_record_dead_letters_a_response_nobody_asked_for():
    stray = InferenceRequest(request_id="r-unknown", conversation_id="c9", user_id="ada", tenant="acme", created_at=1,
                             model="smollm2", messages=[ChatMessage("user", "hi")], sampling=SamplingParams())
    out = FakeOutbox()
    asyncio.run(record({}).handle(messages(RESPONSES, CODEC.encode(response(stray))), out))
    (letter,) = out.records("chat.dlq")
    assert letter.error_type == "UnknownRequestError" and not out.records("chat.turns")


# --- idle expiry ----------------------------------------------------------------------------------


def test_idle_conversations_leave_the_table_and_active_or_waiting_ones_stay():
    """The table used to keep every conversation ever held, restored whole at each start. A sweep now
    removes one whose newest prompt is older than the idle time and that waits for no response; one
    written before active_at existed is dated by its newest recent turn."""
    from streams.expiry import IdleExpiry

    day_ms, now_s = 86_400_000, 100 * 86_400.0
    table: dict = {}
    out = FakeOutbox()
    for conversation in ("old", "new", "waiting"):
        asyncio.run(intake(table).handle(messages(PROMPTS, CODEC.encode(prompt("hi", conversation))), out))
    requests = {r.conversation_id: r for r in out.records(INFERENCE_REQUESTS)}
    for conversation in ("old", "new"):
        asyncio.run(record(table).handle(messages(RESPONSES, CODEC.encode(response(requests[conversation]))),
                                         FakeOutbox()))
    key = {c: state_key("acme", "ada", c) for c in ("old", "new", "waiting", "legacy")}
    for conversation, days_ago in (("old", 40), ("new", 2), ("waiting", 40)):
        table[key[conversation]]["active_at"] = int(now_s * 1000 - days_ago * day_ms)
    legacy = dict(table[key["old"]], conversation_id="legacy", active_at=0)  # before the field: by its recent turn
    legacy["recent"] = [dict(legacy["recent"][0], created_at=int(now_s * 1000 - 31 * day_ms))]
    table[key["legacy"]] = legacy
    assert table[key["waiting"]]["pending"], "the waiting conversation's response is still to come"

    lock = asyncio.Lock()
    expiry = IdleExpiry(table, lambda: lock, idle_s=30 * 86_400, chunk=2, clock=lambda: now_s)
    assert asyncio.run(expiry.sweep()) == 2 and expiry.expired == 2
    assert set(table) == {key["new"], key["waiting"]}


def test_a_prompt_dates_its_conversation():
    table: dict = {}
    asyncio.run(intake(table).handle(messages(PROMPTS, CODEC.encode(prompt("hi"))), FakeOutbox()))
    (value,) = table.values()
    assert value["active_at"] == ConversationState.from_value(value).pending[0].created_at > 0


# --- embeddings -----------------------------------------------------------------------------------


class FakeReplies:
    """The embeddings' reply producer (a confluent-kafka AckedWriter in the worker), faked."""

    def __init__(self) -> None:
        self.results: list[EmbeddingResult] = []

    async def send(self, topic, record, *, key, partition, headers):
        self.results.append(CODEC.decode(CODEC.encode(record)))


def test_embeddings_answers_with_vectors_or_a_reason_and_dead_letters_the_refusal():
    replies = FakeReplies()
    agent = EmbeddingRequests(settings(), services(), DeadLetters(Topic("chat.dlq"), CODEC, "streams.embeddings"),
                              RETRIER, replies, None)
    good = EmbeddingRequest(tenant="acme", user_id="ada", model=DEFAULT_MODEL_NAME, inputs=["a", "b"], reply_to="r")
    wrong = EmbeddingRequest(tenant="acme", user_id="ada", model="gpt-4", inputs=["a"], reply_to="r")
    out = FakeOutbox()
    asyncio.run(agent.handle(messages("chat.embeddings.requests", CODEC.encode(good), CODEC.encode(wrong)), out))
    by_id = {r.request_id: r for r in replies.results}
    assert (by_id[good.request_id].count, by_id[good.request_id].dimensions) == (2, 4)
    assert np.frombuffer(by_id[good.request_id].vectors, dtype="<f4").tolist() == [0.5] * 8
    assert by_id[wrong.request_id].error_code == "model_not_found"
    (letter,) = out.records("chat.dlq")
    assert letter.error_type == "InvalidEmbeddingRequestError" and (agent.served, agent.refused) == (1, 1)


# --- the Faust adapter (streams/faust_runtime/agents.py), Faust's stream faked ---------------------


class FakeEvent:
    def __init__(self, message: Msg) -> None:
        self.message = message


class FakeStream:
    """What ``Batches`` uses of a Faust stream: ``noack_take`` hands the batches out, ``ack`` is recorded."""

    def __init__(self, *batches) -> None:
        self.batches, self.acked = batches, []

    async def noack_take(self, n, within):
        for batch in self.batches:
            yield [FakeEvent(m) for m in batch]

    async def ack(self, event):
        self.acked.append(event.message.offset)


class Recording:
    """An agent that records the order of what happens to its batches."""

    def __init__(self, log: list, fail: bool = False) -> None:
        from streams.ports import BatchRule

        self.batching, self.log, self.fail = BatchRule(8, 0.01), log, fail

    async def handle(self, batch, outbox) -> None:
        self.log.append(("handle", [m.offset for m in batch]))
        await outbox.send(Topic("out"), key=None, value=b"x")
        if self.fail:
            raise RuntimeError("a bug")


class LoggingOutbox(FakeOutbox):
    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    async def deliver(self) -> None:
        self.log.append(("deliver", len(self.sent)))


def test_the_adapter_acks_a_batch_only_after_its_records_are_delivered():
    from streams.faust_runtime.agents import serve

    log: list = []
    stream = FakeStream(messages("in", b"a", b"b"), [Msg("in", 2, b"c")])

    class Acks(FakeStream):
        async def ack(self, event):
            log.append(("ack", event.message.offset))

    stream.__class__ = Acks
    asyncio.run(serve(stream, Recording(log), lambda: LoggingOutbox(log)))
    assert log == [("handle", [0, 1]), ("deliver", 1), ("ack", 0), ("ack", 1),
                   ("handle", [2]), ("deliver", 1), ("ack", 2)]


def test_an_agent_that_fails_ends_the_process_unacked():
    from streams.faust_runtime.agents import faust_agent

    exits: list = []

    def exit(component, exc):
        exits.append((component, type(exc).__name__))

    stream = FakeStream(messages("in", b"a"))
    run = faust_agent("intake", Recording([], fail=True), FakeOutbox, exit=exit)
    asyncio.run(run(stream))
    assert exits == [("streams.intake", "RuntimeError")] and stream.acked == []


# --- the boundary ---------------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["streams.intake", "streams.record", "streams.forget", "streams.archive",
                                    "streams.embedding_requests"])
def test_an_agents_logic_imports_no_faust(module):
    """A newcomer changes what an agent does without Faust: the logic modules import neither faust nor
    streams.faust_runtime (checked in a fresh interpreter)."""
    code = (f"import sys, {module}; bad = sorted(m for m in sys.modules if m.split('.')[0] == 'faust' "
            "or m.startswith('streams.faust_runtime')); print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
