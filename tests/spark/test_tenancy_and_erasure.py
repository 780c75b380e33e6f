"""Datasets never mix tenants or users, feedback counts only from the turn's own tenant and user,
and an erasure (chat.deletions) reaches every dataset built after it (issue 19, points 2 and 3).

One small log, two job runs (Spark local): ``old`` before any Deletion was archived, ``new``
after a USER Deletion of acme/bob and a CONVERSATION Deletion of globex/ada's ``chat-2``.
Both tenants have a conversation ``chat-1`` of a user ``ada`` with the same request ids.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pandas as pd
import pytest

from chatpipe.testing.synthetic_log import START_MS, SyntheticLog, _turn, _Words, to_messages
from schemas.codec import AvroCodec
from schemas.records import ConversationTurn, Deletion, DeletionScope, Feedback, FeedbackKind
from spark_jobs.erasure import affected_datasets, conversation_key, subject_key
from spark_jobs.settings import FinetuneSettings
from transport.archive import ArchivedMessage, write_messages

pytestmark = pytest.mark.spark

MIN = 60_000
DELETED_AT = START_MS + 60 * MIN  # both Deletions
SHARED_PROMPT = "which ferry leaves first tomorrow morning from the north pier?"


class Log:
    """The turns and feedback, with names for the ones the tests look at."""

    def __init__(self) -> None:
        rng = random.Random(19)
        self.words = _Words(rng)
        self.rng = rng
        self.log = SyntheticLog()
        self.turn: dict[str, ConversationTurn] = {}

    def add(self, name: str, tenant: str, user: str, conv: str, idx: int, at: int, prompt: str | None = None,
            answer: str | None = None, request_id: str | None = None) -> ConversationTurn:
        t = _turn(self.rng, conv, idx, prompt or f"{name} {self.words.text(9)}?", answer or self.words.answer(),
                  at, user_id=user, request_id=request_id or f"req-{name}")
        t = replace(t, tenant=tenant)
        self.log.turns.append(t)
        self.turn[name] = t
        return t

    def rate(self, t: ConversationTurn, kind: FeedbackKind, *, tenant: str | None = None, user: str | None = None,
             at: int | None = None, **kw) -> None:
        self.log.feedback.append(Feedback(
            event_id=f"{self.rng.getrandbits(128):032x}", conversation_id=t.conversation_id,
            user_id=user or t.user_id, tenant=tenant or t.tenant, request_id=t.request_id, kind=kind,
            created_at=at or t.completed_at + 5000, **kw))


def _log() -> Log:
    g = Log()
    base = START_MS + 30 * MIN
    # acme/ada chat-1: turn 2 answered twice (regenerated, then thumbed up)
    a0 = g.add("acme0", "acme", "ada", "chat-1", 0, base, request_id="req-0")
    g.add("acme1", "acme", "ada", "chat-1", 1, base + MIN, request_id="req-1")
    a2 = g.add("acme2", "acme", "ada", "chat-1", 2, base + 2 * MIN, prompt=SHARED_PROMPT, request_id="req-2")
    a2b = g.add("acme2b", "acme", "ada", "chat-1", 2, base + 3 * MIN, prompt=SHARED_PROMPT, request_id="req-3")
    g.rate(a2, FeedbackKind.REGENERATE)
    g.rate(a2b, FeedbackKind.THUMBS_UP)
    # globex/ada chat-1: the same request ids req-0..2, the same prompt at turn 2
    g.add("globex0", "globex", "ada", "chat-1", 0, base + 5 * MIN, request_id="req-0")
    gl1 = g.add("globex1", "globex", "ada", "chat-1", 1, base + 6 * MIN, request_id="req-1")
    gl2 = g.add("globex2", "globex", "ada", "chat-1", 2, base + 7 * MIN, prompt=SHARED_PROMPT, request_id="req-2")
    g.rate(gl1, FeedbackKind.THUMBS_DOWN)  # globex's req-1 only, not acme's
    g.rate(gl2, FeedbackKind.THUMBS_UP)
    # feedback from elsewhere: globex on a request only acme has; another acme user on ada's turn
    g.rate(a2b, FeedbackKind.THUMBS_DOWN, tenant="globex", user="eve", at=a2b.completed_at + 9000)
    g.rate(a0, FeedbackKind.EDIT, user="mallory", edited_text="mallory chose this answer instead")
    # acme/bob: erased (USER) at DELETED_AT; comes back after it in b-2
    b0 = g.add("bob0", "acme", "bob", "b-1", 0, START_MS + 10 * MIN, prompt="bobsecretword where is my parcel?")
    g.add("bob1", "acme", "bob", "b-1", 1, START_MS + 11 * MIN, answer="ok")  # dropped too_short: erased anyway
    g.rate(b0, FeedbackKind.EDIT, at=START_MS + 12 * MIN, edited_text="bobeditword the parcel is at the depot")
    g.add("bob_back", "acme", "bob", "b-2", 0, DELETED_AT + 30 * MIN, prompt="bobreturnsword hello again?")
    g.add("globex_bob", "globex", "bob", "gb-1", 0, START_MS + 15 * MIN)  # another tenant's bob: kept
    # globex/ada chat-2: erased (CONVERSATION); chat-3 kept
    g.add("ada_c2_0", "globex", "ada", "chat-2", 0, START_MS + 20 * MIN)
    g.add("ada_c2_1", "globex", "ada", "chat-2", 1, START_MS + 21 * MIN)
    g.add("ada_c3", "globex", "ada", "chat-3", 0, START_MS + 25 * MIN)
    return g


ERASED = ("bob0", "bob1", "ada_c2_0", "ada_c2_1")
DELETIONS = (Deletion(event_id="del-bob", scope=DeletionScope.USER, user_id="bob", tenant="acme", created_at=DELETED_AT),
             Deletion(event_id="del-c2", scope=DeletionScope.CONVERSATION, user_id="ada", tenant="globex",
                      conversation_id="chat-2", created_at=DELETED_AT))


def _deletion_messages() -> list[ArchivedMessage]:
    codec = AvroCodec()
    # the same Deletion twice (redelivered) counts once
    return [ArchivedMessage("chat.deletions", 0, i, d.created_at, f"{d.tenant}/{d.user_id}".encode(), codec.encode(d))
            for i, d in enumerate((*DELETIONS, DELETIONS[0]))]


@pytest.fixture(scope="module")
def runs(spark, tmp_path_factory):
    """(log, datasets root, old result, new result)."""
    from spark_jobs.finetune_dataset import run
    from transport.settings import KafkaSettings

    g = _log()
    tmp = tmp_path_factory.mktemp("tenancy")
    msgs = to_messages(g.log, "chat.turns", "chat.feedback")
    write_messages(tmp / "archive-old", msgs)
    write_messages(tmp / "archive-new", msgs + _deletion_messages())
    root = tmp / "datasets"
    common = dict(source="archive", validation_fraction=0.0, near_dup_threshold=0.95)
    old = run(spark, FinetuneSettings(archive_dir=tmp / "archive-old", out=root / "old", **common), KafkaSettings())
    new = run(spark, FinetuneSettings(archive_dir=tmp / "archive-new", out=root / "new", **common), KafkaSettings())
    return g, root, old, new


def _table(result, name: str) -> pd.DataFrame:
    return pd.read_parquet(result.out / "parquet" / name)


def _everything(result) -> str:
    blobs = []
    for p in sorted(result.out.rglob("*")):
        if p.suffix == ".parquet":
            blobs.append(pd.read_parquet(p).to_json(force_ascii=False))
        elif p.is_file():
            blobs.append(p.read_text(encoding="utf-8"))
    return "\n".join(blobs)


def test_keys_are_the_same_in_spark_and_python(spark):
    """Catches the Spark columns hashing differently from ``subject_key``/``conversation_key`` (an
    erasure check would then find nothing), and keys that collide by concatenation."""
    from spark_jobs.erasure import conversation_key_column, subject_column

    cases = [("acme", "ada", "chat-1"), ("acm", "eada", "chat-1"), ("a:1", "b|2", "ç会話-🙂"), ("", "x", "")]
    got = spark.createDataFrame(cases, "tenant string, user_id string, conversation_id string").select(
        subject_column().alias("s"), conversation_key_column().alias("c")).collect()
    assert [(r.s, r.c) for r in got] == [(subject_key(t, u), conversation_key(t, u, c)) for t, u, c in cases]
    assert len({subject_key(t, u) for t, u, _ in cases}) == len(cases)


def test_two_tenants_chat_1_do_not_mix_in_history_or_pairs(runs):
    """Catches history or preference pairs keyed by the client's conversation id alone: two tenants'
    ``chat-1`` turns interleaved in one example, or a pair of one tenant's chosen and another's rejected."""
    g, _, _, new = runs
    sft = _table(new, "sft").set_index("event_id")
    prompts_of = {tenant: {t.prompt for t in g.log.turns if t.tenant == tenant} for tenant in ("acme", "globex")}
    expected_history = {"acme0": 0, "acme1": 1, "acme2b": 2, "globex0": 0, "globex2": 0}  # globex1 rated down: a gap
    for name, n in expected_history.items():
        t = g.turn[name]
        row = sft.loc[t.event_id]
        users = [m["content"] for m in row["messages"] if m["role"] == "user"]
        assert row["history_turns"] == n, name
        assert set(users) <= prompts_of[t.tenant], f"{name}: history from another tenant"
        assert row["conversation_key"] == conversation_key(t.tenant, t.user_id, "chat-1")
        assert row["subject"] == subject_key(t.tenant, t.user_id) and row["tenant"] == t.tenant
    prefs = _table(new, "preference")
    assert set(zip(prefs["chosen_event_id"], prefs["rejected_event_id"])) == {
        (g.turn["acme2b"].event_id, g.turn["acme2"].event_id)}
    # the raw user id is in no Parquet column of the dataset
    assert "user_id" not in sft.columns and "user_id" not in _table(new, "dropped").columns


def test_feedback_counts_only_from_the_turns_tenant_and_user(runs):
    """Catches feedback joined to turns by request id alone: globex's thumbs-down on its req-1 rating
    acme's req-1 too, a globex key down-rating an acme turn, another acme user "editing" ada's answer."""
    g, _, _, new = runs
    sft_ids = set(_table(new, "sft")["event_id"])
    dropped = _table(new, "dropped").set_index("event_id")
    assert {g.turn[n].event_id for n in ("acme0", "acme1", "acme2b", "globex0", "globex2")} <= sft_ids
    assert tuple(dropped.loc[g.turn["globex1"].event_id, ["step", "reason"]]) == ("feedback", "rated_down")
    assert tuple(dropped.loc[g.turn["acme2"].event_id, ["step", "reason"]]) == ("feedback", "rated_down")
    owner = dropped[dropped["step"] == "feedback_owner"]
    assert sorted(owner["reason"]) == ["other_tenant", "other_user"]
    assert new.card["drops"]["feedback_owner"] == {"other_tenant": 1, "other_user": 1}
    prefs = _table(new, "preference")
    assert (prefs["pair_source"] != "edit").all()  # mallory's edit made no pair
    step = next(s for s in new.card["steps"] if s["step"] == "feedback_owner")
    assert step["dropped"] == 2 and step["input"] == step["kept"] + 2


def test_erased_user_and_conversation_are_absent_from_a_new_dataset(runs):
    """Catches a dataset built after a Deletion that still holds the erased user's turns, feedback
    (an edit's text) or dropped records, or the erased conversation; and an erasure that goes too far
    (the user's turns after the Deletion, another tenant's user of the same id, the user's other
    conversations)."""
    g, _, old, new = runs
    new_text, old_text = _everything(new), _everything(old)
    for word in ("bobsecretword", "bobeditword"):
        assert word in old_text and word not in new_text, word
    ids = set(_table(new, "sft")["event_id"]) | set(_table(new, "dropped")["event_id"])
    old_ids = set(_table(old, "sft")["event_id"]) | set(_table(old, "dropped")["event_id"])
    for name in ERASED:
        assert g.turn[name].event_id in old_ids and g.turn[name].event_id not in ids, name
    sft = set(_table(new, "sft")["event_id"])
    for name in ("bob_back", "globex_bob", "ada_c3", "globex0"):
        assert g.turn[name].event_id in sft, name
    assert "bobreturnsword" in new_text
    assert new.card["erasure"] == {"deletions_read": 2, "deletions_undecodable": 0, "turns_excluded": 4,
                                   "feedback_excluded": 1}
    assert old.card["erasure"]["turns_excluded"] == 0
    assert new.card["input"]["turns_read"] == old.card["input"]["turns_read"]  # read, then left out
    step = next(s for s in new.card["steps"] if s["step"] == "erasure turns")
    assert (step["input"] - step["kept"], step["dropped"]) == (4, 4)
    manifest = json.loads((new.out / "_chatpipe_dataset.json").read_text())
    assert {(a["subject"], a["conversation_key"]) for a in manifest["erasures_applied"]} == {
        (subject_key("acme", "bob"), None),
        (subject_key("globex", "ada"), conversation_key("globex", "ada", "chat-2"))}


def test_affected_datasets_lists_the_older_dataset_only(runs):
    """Catches an erasure check that misses a dataset built before the Deletion, or that reports the
    dataset built after it (which holds only the user's later turns, kept on purpose)."""
    g, root, old, new = runs
    bob = affected_datasets(root, "acme", "bob")
    # old: bob0 (rated down by his edit: dropped), bob1 (dropped), the edit pair, bob_back (SFT, after the Deletion)
    assert [(a.path, a.rows) for a in bob] == [(old.out, 4)]
    c2 = affected_datasets(root, "globex", "ada", "chat-2")
    assert [(a.path, a.rows) for a in c2] == [(old.out, 2)]
    assert c2[0].built_at_ms < json.loads((new.out / "_chatpipe_dataset.json").read_text())["built_at_ms"]
    # not erased: both datasets hold globex/ada's chat-1, and acme's bob is not globex's
    assert [a.path for a in affected_datasets(root, "globex", "ada", "chat-1")] == [new.out, old.out]
    assert affected_datasets(root, "globex", "bob", erased_at_ms=START_MS) == []
    assert affected_datasets(root, "acme", "nobody") == []


def test_active_users_are_counted_per_tenant(spark, runs, tmp_path):
    """Catches the usage report counting two tenants' ``ada`` (or ``bob``) as one active user."""
    from spark_jobs.settings import UsageReportSettings
    from spark_jobs.usage_report import run
    from transport.settings import KafkaSettings

    g = runs[0]
    write_messages(tmp_path / "archive", to_messages(g.log, "chat.turns", "chat.feedback"))
    out = run(spark, UsageReportSettings(source="archive", archive_dir=tmp_path / "archive", out=tmp_path / "r",
                                         charts=False), KafkaSettings())
    usage = pd.read_parquet(out / "usage.parquet")
    expected = {}
    for t in g.log.turns:
        expected.setdefault(t.model, set()).add((t.tenant, t.user_id))
    assert dict(zip(usage["model"], usage["active_users"])) == {m: len(u) for m, u in expected.items()}


@pytest.mark.integration
def test_deletions_are_read_from_the_kafka_topic(spark, runs, kafka_settings, topic_factory, tmp_path):
    """Catches a Kafka-sourced build that ignores the deletions topic (only the archive's copy was read)."""
    from chatpipe.testing.kafka import RecordWriter
    from spark_jobs.finetune_dataset import run

    g, _, _, new = runs
    turns, feedback, deletions = topic_factory(partitions=2), topic_factory(partitions=2), topic_factory(partitions=1)
    msgs = to_messages(g.log, turns, feedback, partitions=2)
    with RecordWriter(kafka_settings) as producer:
        for m in msgs:
            producer.send_bytes(m.topic, m.value, key=m.key, partition=m.partition)
        for d in DELETIONS:
            producer.send(deletions, d, key=f"{d.tenant}/{d.user_id}".encode())
        producer.flush()
    kafka = kafka_settings.model_copy(update={"topic_prefix": ""})  # topic_factory names are full names
    got = run(spark, FinetuneSettings(source="kafka", out=tmp_path / "k", turns_topic=turns, feedback_topic=feedback,
                                      deletions_topic=deletions, validation_fraction=0.0, near_dup_threshold=0.95),
              kafka)
    assert got.card["erasure"] == new.card["erasure"]
    for name in ("sft/train.jsonl", "preference/train.jsonl"):
        assert (got.out / name).read_bytes() == (new.out / name).read_bytes(), name
