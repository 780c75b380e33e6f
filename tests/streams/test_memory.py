"""Conversation memory against real Qdrant: local mode (on disk) and a real one-node server.

Each behaviour test runs twice from one body (``memory`` is parametrised over ``local`` and
``server``); the server is ``../shared/tools/qdrant`` and its runs skip, saying so, where that
tool is absent. Semantic tests use the real all-MiniLM-L6-v2 embedder. The 3-peer cluster with a
peer killed is in test_memory_cluster.py.
"""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from chatpipe.testing.ports import free_port
from chatpipe.testing.qdrant import REPO
from streams.embeddings import turn_text
from streams.memory import (
    ConversationMemory,
    MemoryInputError,
    MemoryLayoutError,
    MemoryUnavailableError,
    RecallQuery,
    StoredTurn,
    point_id,
    recency_weighted,
)
from streams.memory_settings import MemorySettings

T0 = 1_760_000_000_000  # epoch ms of turn 0
MINUTE, DAY = 60_000, 86_400_000


def recall(memory: ConversationMemory, **query) -> list:
    """One query's recall (``recall_many`` of one ``RecallQuery``: tenant, user_id, vector, ...)."""
    return memory.recall_many([RecallQuery(**query)])[0]

FILLER = [
    ("How do I reverse a list in Python?", "Use my_list.reverse() in place, or my_list[::-1] for a copy."),
    ("What's a good name for a grey cat?", "Smokey, Ash, Pebble or Earl Grey are popular choices."),
    ("Explain Kafka consumer groups briefly.", "Consumers in a group split a topic's partitions between them."),
    ("Suggest a weekend hike near Zurich.", "The Uetliberg ridge walk is short and has great views."),
    ("How long should I boil an egg?", "About 7 minutes for a jammy yolk, 10 for hard boiled."),
    ("Translate 'good morning' into Spanish.", "Buenos días."),
    ("What is the capital of Australia?", "Canberra."),
    ("Give me a synonym for 'happy'.", "Cheerful, joyful, content."),
    ("How many bytes are in a kilobyte?", "1000 in SI units, 1024 in the binary convention (a kibibyte)."),
    ("Recommend a sci-fi novel.", "Try 'The Left Hand of Darkness' by Ursula K. Le Guin."),
    ("What does HTTP 404 mean?", "The server could not find the requested resource."),
    ("How do I center a div with CSS?", "Use display:flex with justify-content and align-items set to center."),
    ("Is it going to rain in London tomorrow?", "I can't check live weather, but London often has showers."),
    ("What is a prime number?", "A whole number above 1 divisible only by 1 and itself."),
    ("Write a haiku about autumn.", "Red leaves drift and fall / cold wind hums through bare trees / summer's goodbye."),
    ("How do I undo the last git commit?", "git reset --soft HEAD~1 keeps your changes staged."),
    ("Which planet is the largest?", "Jupiter."),
    ("How do I make cold brew coffee?", "Steep coarse grounds in cold water for 12 to 18 hours, then filter."),
    ("What's the difference between TCP and UDP?", "TCP is reliable and ordered; UDP is connectionless and faster."),
    ("Recommend a stretching routine for runners.", "Calf, hamstring, quad and hip flexor stretches, 30 s each."),
]
FACT = ("By the way, my daughter Matilda is severely allergic to peanuts.", "Thanks, I'll keep that in mind.")
QUESTION = "What is my daughter allergic to?"
FACT_INDEX = 3  # the fact is stated early in a long conversation


def conversation(tenant: str, user: str, conv: str, n: int = 40, with_fact: bool = True) -> list[StoredTurn]:
    """``n`` turns a minute apart; turn FACT_INDEX states the fact (when ``with_fact``)."""
    turns = []
    for i in range(n):
        prompt, answer = FACT if with_fact and i == FACT_INDEX else FILLER[i % len(FILLER)]
        turns.append(StoredTurn(turn_id=f"{tenant}-{user}-{conv}-{i}", tenant=tenant, user_id=user,
                                conversation_id=conv, turn_index=i, prompt=prompt, answer=answer,
                                created_at=T0 + i * MINUTE))
    return turns


@pytest.fixture(scope="session")
def vectors_of(embedder):
    """``vectors_of(turns)``: their embeddings, computed once per distinct text for the session."""
    cache: dict[str, np.ndarray] = {}

    def encode(turns: list[StoredTurn]) -> np.ndarray:
        texts = [turn_text(t) for t in turns]
        missing = sorted({t for t in texts if t not in cache})
        for text, vec in zip(missing, embedder.encode(missing)):
            cache[text] = vec
        return np.stack([cache[t] for t in texts])

    return encode


@pytest.fixture(params=["local", "server"])
def memory(request, tmp_path):
    """``memory(dim=384, **settings) -> ConversationMemory``: a fresh store in local mode (tmp folder)
    or on the real one-node Qdrant server (a fresh collection); closed after the test."""
    url = request.getfixturevalue("qdrant_server") if request.param == "server" else None
    made: list[ConversationMemory] = []

    def make(dim: int = 384, **overrides) -> ConversationMemory:
        name = f"turns_{uuid.uuid4().hex[:10]}"
        settings = MemorySettings(**{"path": tmp_path / name, "url": url, "collection": name, **overrides})
        made.append(ConversationMemory(settings, dim))
        return made[-1]

    yield make
    for m in made:
        m.close()


def ids(recalled) -> list[str]:
    return [r.turn.turn_id for r in recalled]


def test_recall_finds_fact_from_turn_3_among_40_turns(memory, embedder, vectors_of):
    """Guards against recall that misses an old but relevant turn (e.g. recency or limit cutting it)."""
    mem = memory()
    turns = conversation("acme", "alice", "c1")
    mem.upsert(turns, vectors_of(turns))
    got = recall(mem, tenant="acme", user_id="alice", vector=embedder.encode([QUESTION])[0], now_ms=T0 + 40 * MINUTE)
    assert got and got[0].turn.turn_id == turns[FACT_INDEX].turn_id, [r.turn.prompt for r in got]
    assert got[0].turn == turns[FACT_INDEX]  # the whole turn comes back, not only its id
    assert len(got) <= mem.settings.recall_limit


def test_other_tenant_with_same_user_id_gets_nothing_of_the_first(memory, embedder, vectors_of):
    """Guards against a tenant leak: filtering on user_id alone would hand globex's alice acme's fact."""
    mem = memory()
    acme = conversation("acme", "alice", "c1")
    globex = conversation("globex", "alice", "c9", n=10, with_fact=False)
    mem.upsert(acme + globex, vectors_of(acme + globex))
    question = embedder.encode([QUESTION])[0]
    got = recall(mem, tenant="globex", user_id="alice", vector=question, limit=10, now_ms=T0 + DAY)
    assert all(r.turn.tenant == "globex" for r in got), ids(got)
    assert not [r for r in got if "Matilda" in r.turn.prompt]
    # the same question from acme's alice does find it: the isolation, not a weak match, hid it above
    assert "Matilda" in recall(mem, tenant="acme", user_id="alice", vector=question, now_ms=T0 + DAY)[0].turn.prompt
    assert recall(mem, tenant="initech", user_id="alice", vector=question) == []


def test_recency_orders_equally_similar_turns_newest_first(memory):
    """Guards against ranking by similarity alone (or by age the wrong way round)."""
    mem = memory(dim=4, recency_half_life_s=DAY / 1000)
    v = np.array([[1, 0, 0, 0]] * 3, dtype=np.float32)
    turns = [StoredTurn(f"r{i}", "acme", "bob", "c1", i, f"same {i}", "same", T0 + i * DAY) for i in (0, 2, 1)]
    mem.upsert(turns, v)
    got = recall(mem, tenant="acme", user_id="bob", vector=v[0], now_ms=T0 + 3 * DAY)
    assert ids(got) == ["r2", "r1", "r0"]
    assert [round(r.similarity, 4) for r in got] == [1.0, 1.0, 1.0]
    assert [round(r.score, 4) for r in got] == [0.5, 0.25, 0.125]  # 0.5 ** (age / half-life)


def test_recency_weight_formula():
    """Guards against a silent change of the documented formula (half-life semantics, future turns)."""
    assert recency_weighted(0.8, T0, T0, 3600) == pytest.approx(0.8)
    assert recency_weighted(0.8, T0, T0 + 3_600_000, 3600) == pytest.approx(0.4)
    assert recency_weighted(0.8, T0 + 10_000, T0, 3600) == pytest.approx(0.8)  # clock skew: not above 1x


def test_exclude_turn_ids_are_never_recalled(memory, embedder, vectors_of):
    """Guards against recalling turns the caller already has in its recent window (duplicated context)."""
    mem = memory(min_score=-1.0)  # every turn qualifies: only the exclusion may remove the window
    turns = conversation("acme", "alice", "c1")
    mem.upsert(turns, vectors_of(turns))
    question = embedder.encode([QUESTION])[0]
    fact_id = turns[FACT_INDEX].turn_id
    assert fact_id in ids(recall(mem, tenant="acme", user_id="alice", vector=question))
    window = [fact_id] + [t.turn_id for t in turns[-8:]]
    got = recall(mem, tenant="acme", user_id="alice", vector=question, limit=40, exclude_turn_ids=window)
    assert len(got) == 40 - len(window) and not set(ids(got)) & set(window)


def test_forget_conversation_then_user_leaves_nothing_recallable(memory, embedder, vectors_of):
    """Guards against forget() missing points (wrong filter) or deleting other users' or tenants' turns."""
    mem = memory()
    c1, c2 = conversation("acme", "alice", "c1"), conversation("acme", "alice", "c2", n=12)
    bob, other_tenant = conversation("acme", "bob", "c3", n=12), conversation("globex", "alice", "c4", n=12)
    everything = c1 + c2 + bob + other_tenant
    mem.upsert(everything, vectors_of(everything))
    question = embedder.encode([QUESTION])[0]

    assert mem.forget(tenant="acme", user_id="alice", conversation_id="c1") == len(c1)
    assert mem.count(tenant="acme", user_id="alice", conversation_id="c1") == 0
    left = recall(mem, tenant="acme", user_id="alice", vector=question, limit=100, now_ms=T0)
    assert left and all(r.turn.conversation_id == "c2" for r in left)
    assert mem.count(tenant="acme", user_id="alice") == len(c2)

    assert mem.forget(tenant="acme", user_id="alice") == len(c2)
    assert mem.count(tenant="acme", user_id="alice") == 0
    assert recall(mem, tenant="acme", user_id="alice", vector=question, limit=100) == []
    assert mem.forget(tenant="acme", user_id="alice") == 0  # again: nothing left, no error
    # the others are untouched
    assert mem.count(tenant="acme", user_id="bob") == len(bob)
    assert mem.count(tenant="globex", user_id="alice") == len(other_tenant)
    assert mem.count() == len(bob) + len(other_tenant)
    assert "Matilda" in recall(mem, tenant="globex", user_id="alice", vector=question)[0].turn.prompt


def test_upsert_is_idempotent_by_turn_id(memory, vectors_of):
    """Guards against duplicates when the record agent re-upserts a batch after a crash."""
    mem = memory()
    turns = conversation("acme", "alice", "c1", n=12)
    vectors = vectors_of(turns)
    mem.upsert(turns, vectors)
    mem.upsert(turns, vectors)
    assert mem.count() == 12
    edited = StoredTurn(**{**{f: getattr(turns[5], f) for f in StoredTurn.__slots__}, "answer": "edited answer"})
    mem.upsert([edited], vectors[5:6])
    assert mem.count() == 12
    got = recall(mem, tenant="acme", user_id="alice", vector=vectors[5], limit=1, now_ms=T0)
    assert got[0].turn == edited
    assert point_id("x") == point_id("x") != point_id("y")


def test_recall_many_equals_one_recall_per_query(memory, embedder, vectors_of):
    """Guards against the batched path mixing up queries (order, filters, excludes, limits)."""
    mem = memory()
    turns = (conversation("acme", "alice", "c1") + conversation("acme", "bob", "c2", n=15)
             + conversation("globex", "alice", "c3", n=20, with_fact=False))
    mem.upsert(turns, vectors_of(turns))
    q = embedder.encode([QUESTION, "How do I boil eggs?", "Tell me a poem about fall"])
    queries = [RecallQuery("acme", "alice", q[0], now_ms=T0), RecallQuery("globex", "alice", q[0], limit=6, now_ms=T0),
               RecallQuery("acme", "bob", q[1], exclude_turn_ids=("acme-bob-c2-4",), now_ms=T0),
               RecallQuery("acme", "alice", q[2], limit=2, now_ms=T0), RecallQuery("nobody", "x", q[1]),
               RecallQuery("acme", "alice", q[1], limit=0)]
    batched = mem.recall_many(queries)
    single = [recall(mem, tenant=x.tenant, user_id=x.user_id, vector=x.vector, limit=x.limit,
                         exclude_turn_ids=x.exclude_turn_ids, now_ms=x.now_ms) for x in queries]
    assert [ids(b) for b in batched] == [ids(s) for s in single]
    assert [[round(r.score, 5) for r in b] for b in batched] == [[round(r.score, 5) for r in s] for s in single]
    assert [len(b) for b in batched][:2] != [0, 0] and batched[4] == [] and batched[5] == []


def test_bad_vectors_and_keys_raise_named_errors(memory):
    """Guards against storing vectors of the wrong size or unowned turns (no tenant) silently."""
    mem = memory(dim=4)
    turn = StoredTurn("t1", "acme", "bob", "c1", 0, "p", "a", T0)
    with pytest.raises(MemoryInputError, match=r"shape \(1, 4\)"):
        mem.upsert([turn], np.ones((1, 5), dtype=np.float32))
    with pytest.raises(MemoryInputError, match="NaN"):
        mem.upsert([turn], np.full((1, 4), np.nan, dtype=np.float32))
    with pytest.raises(MemoryInputError, match="non-empty"):
        mem.upsert([StoredTurn("t2", "", "bob", "c1", 0, "p", "a", T0)], np.ones((1, 4), dtype=np.float32))
    with pytest.raises(MemoryInputError, match="non-empty"):
        mem.forget(tenant="acme", user_id="")
    assert mem.count() == 0


def test_reopening_with_another_vector_size_is_refused(memory):
    """Guards against mixing embeddings of two models (sizes differ) in one collection."""
    mem = memory(dim=4)
    mem.upsert([StoredTurn("t1", "acme", "bob", "c1", 0, "p", "a", T0)], np.ones((1, 4), dtype=np.float32))
    settings = mem.settings
    mem.close()
    with pytest.raises(MemoryLayoutError, match="size 4"):
        ConversationMemory(settings, 8)


def test_local_memory_survives_a_restart(tmp_path, embedder, vectors_of):
    """Guards against local mode keeping turns only in memory (lost when the worker restarts), against
    reopening a folder with another partition count, and against the SQLite tuning silently vanishing."""
    settings = MemorySettings(path=tmp_path / "q")
    mem = ConversationMemory(settings, embedder.dim)
    turns = conversation("acme", "alice", "c1")
    mem.upsert(turns, vectors_of(turns))
    mem.close()
    # the speed tuning of streams.memory_local still reaches qdrant-client's SQLite files
    files = list((tmp_path / "q").rglob("storage.sqlite"))
    assert files and all(sqlite3.connect(f).execute("PRAGMA journal_mode").fetchone()[0] == "wal" for f in files)
    with pytest.raises(MemoryLayoutError, match="local_partitions"):
        ConversationMemory(MemorySettings(path=tmp_path / "q", local_partitions=7), embedder.dim).close()
    again = ConversationMemory(settings, embedder.dim)
    try:
        assert again.count(tenant="acme", user_id="alice") == 40
        got = recall(again, tenant="acme", user_id="alice", vector=embedder.encode([QUESTION])[0])
        assert got[0].turn == turns[FACT_INDEX]
    finally:
        again.close()


def test_too_low_open_files_limit_is_a_named_error_not_a_crash_later(tmp_path):
    """Guards against local mode running out of file descriptors mid-run (3 per partition in WAL mode)
    when the hard limit is too low: it must refuse at start, saying what to change."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))\n"
            "from streams.memory import ConversationMemory, MemoryLayoutError\n"
            "from streams.memory_settings import MemorySettings\n"
            "try:\n    ConversationMemory(MemorySettings(path=sys.argv[1], local_partitions=256), 4)\n"
            "except MemoryLayoutError as exc:\n    print(exc)\n    sys.exit(3)\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "q")], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 3, done.stderr
    assert "CHATPIPE_MEMORY_LOCAL_PARTITIONS" in done.stdout


def test_server_down_raises_memory_unavailable_naming_the_url():
    """Guards against a raw httpx/qdrant exception (or a hang) when the configured server is down."""
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(MemoryUnavailableError, match=url.replace(".", r"\.")):
        ConversationMemory(MemorySettings(url=url, retries=2, retry_backoff_s=0.05, timeout_s=1), 4)
    assert time.monotonic() - started < 10


def test_embedder_encodes_normalised_float32(embedder):
    """Guards against unnormalised or float64 vectors (cosine scores and Qdrant payload size depend on it)."""
    vectors = embedder.encode(["hello there", "a completely different sentence"] * 40)
    assert vectors.shape == (80, embedder.dim) and embedder.dim == 384 and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert embedder.encode([]).shape == (0, 384)
    similar = embedder.encode(["My dog is called Rex.", "What is my dog's name?", "Stock markets fell today."])
    assert similar[0] @ similar[1] > similar[0] @ similar[2]


async def test_aencode_runs_off_the_event_loop(embedder):
    """Guards against encoding on the event loop thread, which would stall every other agent."""
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    texts = [f"sentence number {i} about something else entirely" for i in range(256)]
    vectors = await embedder.aencode(texts)
    task.cancel()
    assert ticks >= 3, "the event loop did not run while the model encoded"
    assert np.allclose(vectors, embedder.encode(texts), atol=1e-5)


def test_a_prompt_embedded_lately_is_not_embedded_again_and_only_intakes_prompts_are_kept(embedder):
    """``encode(reuse=True)`` (intake's prompts): a text seen within the TTL comes from the cache, the same
    vector, without a forward pass; a repeat inside one batch is embedded once; the memory writer's texts
    (``reuse`` False) are not kept. The cache keys are hashes: no text is held."""
    from unittest import mock

    texts = [f"How do I reset my password? ({uuid.uuid4().hex})", f"Where is my order? ({uuid.uuid4().hex})"]
    first = embedder.encode([texts[0], texts[1], texts[0]], reuse=True)
    assert np.array_equal(first[0], first[2])
    with mock.patch.object(embedder.model, "encode", side_effect=AssertionError("embedded again")):
        again = embedder.encode([texts[1], texts[0]], reuse=True)
    assert np.array_equal(again, first[[1, 0]]) and embedder.reused >= 3
    assert not any(isinstance(k, str) for k in embedder.recent)
    turn = f"user: hi\nassistant: hello ({uuid.uuid4().hex})"
    before = len(embedder.recent)
    embedder.encode([turn])
    assert len(embedder.recent) == before, "the memory writer's texts are not kept"
    embedder.forget_recent()  # an erasure (streams/app.py's follower): nothing kept is reused after it
    assert len(embedder.recent) == 0
