"""The response cache in the agents' logic (streams/response_cache.py, intake, record, forget) on a real Redis.

A real ``redis-server`` (``chatpipe.testing.redis``) for every test; the broker and memory are faked as in
tests/streams/test_agent_logic.py (its ``FakeOutbox``, ``FakeMemory``; the outbox keeps what would be
produced). What the whole stack does with it (a gateway, a worker, Kafka) is tests/cache.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from types import SimpleNamespace

import pytest

from chatpipe.testing.redis import RedisServer
from schemas.records import (
    ChatMessage,
    Deletion,
    DeletionAudit,
    DeletionScope,
    FinishReason,
    InferenceRequest,
    Response,
    SamplingParams,
    TokenChunk,
)
from schemas.topics import DELETIONS, INFERENCE_REQUESTS, INFERENCE_REQUESTS_BATCH, PROMPTS, RESPONSES
from streams.cache_answers import CachedAnswers
from streams.cache_settings import CacheSettings
from streams.dead_letters import DeadLetters
from streams.erasures import ErasureRegistry
from streams.forget import Forget
from streams.intake import Intake
from streams.record import Record
from streams.refusals import Refusals
from streams.response_cache import CACHE_WORKER_ID, CacheServer, ResponseCache
from streams.services import StreamsServices
from streams.tokens import TokenCounter
from tests.streams.test_agent_logic import CODEC, RETRIER, FakeEmbedder, FakeOutbox, Topic, messages, settings

pytestmark = pytest.mark.integration  # a real redis-server process


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


class RecallingMemory:
    """Memory, faked: what each user's recall returns (a user's own facts), so that two users asking one
    question get different contexts when their memories differ."""

    def __init__(self, facts: dict[str, str]) -> None:
        self.facts = facts

    def recall_many(self, queries):
        hits = []
        for q in queries:
            fact = self.facts.get(q.user_id)
            turn = SimpleNamespace(prompt=fact, answer="Noted.", created_at=1, turn_id=f"t-{q.user_id}",
                                   tenant=q.tenant, user_id=q.user_id, conversation_id="old")
            hits.append([SimpleNamespace(turn=turn, score=0.9)] if fact else [])
        return hits


class Replies:
    """The reply producer, faked (the broker): the chunks sent to reply addresses."""

    def __init__(self) -> None:
        self.chunks: list[TokenChunk] = []

    async def send(self, topic, record, **_):
        self.chunks.append(record)


class Pipeline:
    """Intake, record and forget of one streams worker sharing one table, one cache and one registry."""

    def __init__(self, url: str, facts: dict[str, str] | None = None, prefix: str = "t:") -> None:
        self.table: dict = {}
        self.loop = asyncio.new_event_loop()  # one loop, as in a streams worker: the Redis client is bound to it
        self.cache = ResponseCache(CacheSettings(url=url, key_prefix=prefix, retry_after_s=0.5))
        self.replies = Replies()
        self.erasures = ErasureRegistry()
        self.services = StreamsServices(memory=RecallingMemory(facts or {}), embedder=FakeEmbedder(),
                                        counter=TokenCounter(lambda t: t.split()))
        letters = DeadLetters(Topic("chat.dlq"), CODEC, "streams.intake")
        answers = CachedAnswers(self.replies, None, RETRIER, Topic(RESPONSES), CODEC)
        self.intake = Intake(settings(), self.services, self.table,
                             {n: Topic(n) for n in (INFERENCE_REQUESTS, INFERENCE_REQUESTS_BATCH)}, letters,
                             Refusals(letters, RETRIER, None, None), RETRIER, erasures=self.erasures,
                             cache=self.cache, cached_answers=answers)
        self.record = Record(settings(), self.services, self.table, Topic("chat.turns"),
                             DeadLetters(Topic("chat.dlq"), CODEC, "streams.record"), self.erasures, cache=self.cache)
        self.forget = Forget(self.services, Topic("fanout"), 6, DeadLetters(Topic("chat.dlq"), CODEC, "streams.forget"),
                             RETRIER, erasures=self.erasures, cache=self.cache, audit_topic=Topic("audit"))

    def ask(self, text: str, *, user: str = "ada", tenant: str = "acme", conversation: str | None = None,
            answer: str = "Paris.", **sampling) -> tuple[str, object]:
        """One prompt through intake and, if a worker got it, its answer through record: ("hit", chunk),
        ("miss", request) or ("bypass", request) as the cache saw it."""
        from schemas.records import PromptRequest

        opted = sampling.pop("response_cache", True)
        params = SamplingParams(**{"max_tokens": 16, "temperature": 0.0, **sampling})
        prompt = PromptRequest(conversation_id=conversation or f"c-{user}-{uuid.uuid4().hex[:8]}", user_id=user, tenant=tenant,
                               model="smollm2", messages=[ChatMessage("user", text)], sampling=params,
                               reply_to="replies", response_cache=opted)
        out = FakeOutbox()
        self.loop.run_until_complete(self.intake.handle(messages(PROMPTS, CODEC.encode(prompt)), out))
        sent = out.records(INFERENCE_REQUESTS)
        if not sent:  # answered from the cache
            (response,) = out.records(RESPONSES)
            self._record(response)
            return "hit", self.replies.chunks[-1]
        (request,) = sent
        self._record(worker_response(request, answer))
        return ("miss" if self._pending_key(request) else "bypass"), request

    def _pending_key(self, request: InferenceRequest) -> bool:
        return request.request_id in self.intake._cache_keys

    def _record(self, response: Response) -> None:
        out = FakeOutbox()
        self.loop.run_until_complete(self.record.handle(messages(RESPONSES, CODEC.encode(response)), out))
        self.turns = out.records("chat.turns")

    def erase(self, user: str, tenant: str = "acme", scope: DeletionScope = DeletionScope.USER) -> list:
        out = FakeOutbox()
        deletion = Deletion(scope=scope, tenant=tenant, user_id=user,
                            conversation_id="c1" if scope is DeletionScope.CONVERSATION else None)
        self.loop.run_until_complete(self.forget.handle(messages(DELETIONS, CODEC.encode(deletion)), out))
        return out.records("audit")


def worker_response(request: InferenceRequest, text: str) -> Response:
    return Response(request_id=request.request_id, conversation_id=request.conversation_id, user_id=request.user_id,
                    tenant=request.tenant, text=text, model=request.model, worker_id="w1", tokens_in=request.context_tokens,
                    tokens_out=2, queue_ms=1, ttft_ms=2, total_ms=3, finish_reason=FinishReason.STOP,
                    created_at=request.created_at, cached_tokens=4)


def test_a_second_asker_with_the_same_context_is_answered_from_the_cache_without_a_worker(redis_server, tmp_path):
    p = Pipeline(redis_server.url, prefix=f"{tmp_path.name}:")
    outcome, request = p.ask("What is the capital of France?", user="ada")
    assert outcome == "miss" and p.cache.stored == 1
    outcome, chunk = p.ask("What is the capital of France?", user="bob")  # same tenant, same (empty) memory
    assert outcome == "hit", "the same assembled context in one tenant shares the answer"
    assert (chunk.text, chunk.is_final, chunk.finish_reason, chunk.worker_id) == ("Paris.", True, FinishReason.STOP,
                                                                                   CACHE_WORKER_ID)
    assert chunk.response_cached and chunk.cached_tokens == chunk.tokens_in == request.context_tokens
    (turn,) = p.turns  # recorded as a turn of bob's conversation, as usual
    assert (turn.user_id, turn.answer, turn.response_cached, turn.worker_id) == ("bob", "Paris.", True, CACHE_WORKER_ID)
    assert turn.cached_tokens == turn.tokens_in
    assert p.cache.hits["acme"] == 1 and p.cache.misses["acme"] == 1


def test_users_with_different_memories_and_different_tenants_never_share_an_answer(redis_server, tmp_path):
    p = Pipeline(redis_server.url, facts={"ada": "My cat is Tom.", "bob": "My cat is Felix."},
                 prefix=f"{tmp_path.name}:")
    assert p.ask("What is my cat called?", user="ada", answer="Tom.")[0] == "miss"
    outcome, request = p.ask("What is my cat called?", user="bob", answer="Felix.")
    assert outcome == "miss", "bob's recalled memory differs from ada's: another context, another key"
    assert "My cat is Felix." in [m.content for m in request.messages]
    assert p.ask("What is my cat called?", user="ada")[0] == "hit"  # ada's own entry
    # another tenant, the same (empty) memory and question: never ada's tenant's entry
    q = Pipeline(redis_server.url, prefix=f"{tmp_path.name}:")
    assert q.ask("What is the capital of Spain?", tenant="acme", answer="Madrid.")[0] == "miss"
    assert q.ask("What is the capital of Spain?", tenant="globex", answer="Madrid!")[0] == "miss"
    assert q.ask("What is the capital of Spain?", tenant="globex", user="eve")[1].text == "Madrid!"


def test_other_tools_response_format_or_seed_miss_and_sampled_or_opted_out_requests_bypass(redis_server, tmp_path):
    p = Pipeline(redis_server.url, prefix=f"{tmp_path.name}:")
    question = "List three colours."
    assert p.ask(question, seed=1)[0] == "miss"
    assert p.ask(question, user="bob", seed=1)[0] == "hit"
    assert p.ask(question, user="bob", seed=2)[0] == "miss", "another seed is another answer"
    fmt = '{"type": "json_object"}'
    assert p.ask(question, user="bob", response_format=fmt)[0] == "miss", "a response_format (tools too) is in the key"
    assert p.ask(question, user="bob", max_tokens=17)[0] == "miss"
    before = dict(p.cache.bypasses)
    assert p.ask(question, user="bob", temperature=0.8)[0] == "bypass", "sampled without a seed"
    assert p.ask(question, user="bob", response_cache=False)[0] == "bypass", "opted out"
    assert p.ask(question, user="bob", n=2)[0] == "bypass"
    assert p.ask(question, user="bob", logprobs=True)[0] == "bypass"
    counted = {k: v - before.get(k, 0) for k, v in p.cache.bypasses.items() if v != before.get(k, 0)}
    assert counted == {("acme", "sampled"): 1, ("acme", "opted_out"): 1, ("acme", "n"): 1, ("acme", "logprobs"): 1}


def test_an_erased_users_entries_are_deleted_audited_and_never_served_again(redis_server, tmp_path):
    p = Pipeline(redis_server.url, prefix=f"{tmp_path.name}:")
    p.ask("What is the capital of Italy?", user="ada", answer="Rome.")
    p.ask("Name a river.", user="ada", answer="The Po.")
    p.ask("Name a mountain.", user="bob", answer="Etna.")
    server = CacheServer(p.cache.settings)
    assert len(server.entries_of("acme", "ada")) == 2
    (audit,) = p.erase("ada")
    assert isinstance(audit, DeletionAudit) and audit.component == "streams.response-cache"
    assert audit.conversations_cleared == 2  # entries removed (docs/privacy.md)
    assert server.entries_of("acme", "ada") == [] and len(server.entries_of("acme", "bob")) == 1
    assert p.ask("What is the capital of Italy?", user="carl")[0] == "miss", "ada's answer is gone"
    assert p.ask("Name a mountain.", user="carl")[0] == "hit", "bob's stays"


def test_an_entry_whose_owner_was_erased_after_it_was_written_is_not_served_even_if_still_there(redis_server,
                                                                                                 tmp_path):
    """The registry's second look: an erasure whose Redis delete has not happened (or an index evicted by LRU)."""
    p = Pipeline(redis_server.url, prefix=f"{tmp_path.name}:")
    p.ask("What is the capital of Peru?", user="ada", answer="Lima.")
    p.erasures.add(Deletion(scope=DeletionScope.USER, tenant="acme", user_id="ada"))  # registered, not carried out
    assert p.ask("What is the capital of Peru?", user="bob")[0] == "miss" and p.cache.hidden == 1


def test_a_retired_model_versions_entries_are_not_served(redis_server, tmp_path):
    """Model versions do not exist yet (issue 41/42's chat.models): the version is the model name, and the test
    retires it the way a chat.models follower will, through ``retire_version``."""
    p = Pipeline(redis_server.url, prefix=f"{tmp_path.name}:")
    p.ask("What is the capital of Chile?", user="ada", answer="Santiago.")
    assert p.ask("What is the capital of Chile?", user="bob")[0] == "hit"
    p.loop.run_until_complete(p.cache.retire_version("smollm2"))
    assert p.ask("What is the capital of Chile?", user="carl")[0] == "miss"


def test_redis_killed_bypasses_the_cache_counted_and_redis_back_is_used_again(tmp_path):
    with RedisServer(tmp_path, name="killed") as server:
        p = Pipeline(server.url)
        p.ask("What is the capital of Japan?", user="ada", answer="Tokyo.")
        server.kill()
        outcome, request = p.ask("What is the capital of Japan?", user="bob", answer="Tokyo!")
        assert outcome == "miss" and isinstance(request, InferenceRequest), "answered by a worker, not refused"
        assert p.cache.bypasses[("acme", "unavailable")] == 1 and p.cache.store_failures == 1
        server.start()  # empty: a cache, nothing persisted
        import time

        time.sleep(0.6)  # retry_after_s
        assert p.ask("What is the capital of Japan?", user="carl", answer="Tokyo.")[0] == "miss"
        assert p.ask("What is the capital of Japan?", user="dan")[0] == "hit", "used again"


def test_an_erasure_while_redis_is_away_is_retried_not_acknowledged(tmp_path):
    with RedisServer(tmp_path, name="away") as server:
        p = Pipeline(server.url)
        server.kill()
        from streams.faults import InfrastructureUnavailableError

        with pytest.raises(InfrastructureUnavailableError):
            p.erase("ada")  # the batch is not acked: read again after the restart


def test_state_values_written_before_the_cache_still_read(redis_server):
    """A table value of an older worker has no cache_key on its pending entries."""
    from streams.state import ConversationState, PendingRequest

    state = ConversationState("acme", "ada", "c1")
    state.add_pending(PendingRequest("r1", "hi", None, 1), 8)
    value = state.to_value()
    del value["pending"][0]["cache_key"]
    assert ConversationState.from_value(value).pending[0].cache_key is None
    assert replace(state.pending[0]).cache_key is None


def test_metrics_count_hits_misses_bypasses_per_tenant_and_read_bytes_and_lru_evictions_from_redis(tmp_path):
    """/metrics (streams/metrics.py ``cache_metrics``): the cache's counters per tenant, and from the server its
    bytes used and the keys allkeys-lru evicted once maxmemory is reached (a 2 MB server filled with 4 MB)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from streams.metrics import cache_metrics
    from streams.response_cache import CachedAnswer, CacheKey

    with RedisServer(tmp_path, name="small", maxmemory="2mb") as server:
        p = Pipeline(server.url)
        p.ask("What is the capital of Kenya?", user="ada", answer="Nairobi.")
        p.ask("What is the capital of Kenya?", user="bob")
        p.ask("What is the capital of Kenya?", user="bob", temperature=0.9)
        filler = [(CacheKey("globex", f"{i:064x}", "m"), CachedAnswer("x" * 1000, "STOP", 1, 1, "m", "globex", "u",
                                                                       "c", 1, f"r{i}", 1)) for i in range(4000)]
        for start in range(0, len(filler), 500):
            p.loop.run_until_complete(p.cache.store(filler[start:start + 500]))
        info = CacheServer(p.cache.settings)

        class Collector:
            def collect(self):
                return cache_metrics(p.cache, info.info)

        registry = CollectorRegistry()
        registry.register(Collector())
        text = generate_latest(registry).decode()
    assert 'chatpipe_streams_response_cache_hits_total{tenant="acme"} 1.0' in text
    assert 'chatpipe_streams_response_cache_misses_total{tenant="acme"} 1.0' in text
    assert 'chatpipe_streams_response_cache_bypasses_total{reason="sampled",tenant="acme"} 1.0' in text
    used = float(next(line.split()[-1] for line in text.splitlines() if line.startswith("chatpipe_response_cache_bytes ")))
    evicted = float(next(line.split()[-1] for line in text.splitlines()
                         if line.startswith("chatpipe_response_cache_evictions_total ")))
    assert 0 < used <= 2.5 * 2**20 and evicted > 0, (used, evicted)
