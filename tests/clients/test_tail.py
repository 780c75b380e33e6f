"""``chatpipe tail``: catalog topics decoded to JSON lines, against the real test broker.

In-process tests drive ``clients.topic_tail.TopicTail``; the CLI tests run ``chatpipe tail`` as
a subprocess, because what they guard (live start point, SIGTERM, a closed pipe, one-line
errors) is about the process, not the module.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from chatpipe.testing.ports import free_port
from schemas.records import (ConversationTurn, DeadLetter, EmbeddingResult, Feedback, FeedbackKind, FinishReason,
                             Header, Response, TokenChunk)
from schemas.topics import CATALOG

pytestmark = pytest.mark.integration

CHATPIPE = str(Path(sys.executable).with_name("chatpipe"))
TOPICS = {"chat.feedback": 3, "chat.turns": 2, "chat.dlq": 1, "chat.replies.gw-1": 1}


@pytest.fixture
def tail_kafka(kafka_stack, topic_admin):
    """KafkaSettings under a prefix of this test's own with the topics it uses: nothing another
    test writes to the session's catalog can show up in its tail."""
    from transport.settings import KafkaSettings

    kafka = KafkaSettings(bootstrap_servers=kafka_stack.bootstrap_servers, topic_prefix=f"tail{uuid.uuid4().hex[:8]}.")
    for name, partitions in TOPICS.items():
        topic_admin.create_topic(kafka.topic(name), partitions)
    return kafka


@pytest.fixture
def producer(tail_kafka):
    from chatpipe.testing.kafka import RecordWriter

    with RecordWriter(tail_kafka) as p:
        yield p


def feedback(conversation_id: str, kind: FeedbackKind = FeedbackKind.THUMBS_UP, **kw) -> Feedback:
    return Feedback(conversation_id=conversation_id, user_id="u1", tenant="acme", request_id="r1", kind=kind,
                    created_at=1_700_000_000_123, **kw)


def read_all(kafka, name: str, **kw) -> list[dict]:
    from clients.topic_tail import TopicTail

    with TopicTail(kafka, name, from_beginning=True, **kw) as tail:
        return [line for batch in tail.batches(idle_timeout_s=2.0) for line in batch]


def test_from_beginning_decodes_records_and_shows_undecodable_ones(tail_kafka, producer):
    """Guards against: a value that does not decode (junk, or another record type on the topic)
    being skipped or crashing the tail, and decoded values that are not plain JSON (enums as
    objects, timestamps as datetimes, bytes that json cannot write)."""
    junk = b"\x00\x01not avro"
    producer.send(tail_kafka.topic("chat.feedback"), feedback("c1", FeedbackKind.EDIT, edited_text="better"), key="c1",
                  partition=0)
    producer.send_bytes(tail_kafka.topic("chat.feedback"), junk, key=b"\xff\xfe", partition=0)
    producer.send(tail_kafka.topic("chat.feedback"), Response(
        request_id="r2", conversation_id="c1", user_id="u", tenant="t", text="hi", model="m", worker_id="w",
        tokens_in=1, tokens_out=1, queue_ms=0.0, ttft_ms=0.0, total_ms=1.0, finish_reason=FinishReason.STOP,
        created_at=1), key="c1", partition=0)
    producer.send(tail_kafka.topic("chat.turns"), ConversationTurn(
        conversation_id="c1", user_id="u1", tenant="acme", request_id="r1", turn_index=0, prompt="My cat is Pixel",
        answer="Nice!", model="m", worker_id="w0", tokens_in=5, tokens_out=2, queue_ms=1.5, total_ms=9.0,
        finish_reason=FinishReason.STOP, created_at=1_700_000_000_000, completed_at=1_700_000_000_500), key="c1")
    dead_value = b"\xc3\x01broken"
    producer.send(tail_kafka.topic("chat.dlq"), DeadLetter(
        source_topic="x", source_partition=2, source_offset=7, key=b"k", value=dead_value,
        headers=[Header("traceparent", b"00-ab")], error_type="DecodeError", error_message="bad", component="test"))
    producer.flush()

    lines = read_all(tail_kafka, "chat.feedback")
    assert [json.loads(json.dumps(x)) for x in lines] == lines  # plain JSON types only
    good, bad_junk, wrong_type = sorted(lines, key=lambda x: x["offset"])
    assert good["topic"] == tail_kafka.topic("chat.feedback") and good["key"] == "c1"
    assert good["type"] == "Feedback"
    assert good["value"]["kind"] == "EDIT" and good["value"]["edited_text"] == "better"
    assert good["value"]["created_at"] == 1_700_000_000_123
    assert isinstance(good["timestamp"], int) and good["timestamp"] > 1_700_000_000_000
    assert [h["key"] for h in good["headers"]] == ["traceparent"] and good["headers"][0]["value"].startswith("00-")
    assert "marker" in bad_junk["error"] and base64.b64decode(bad_junk["value_base64"]) == junk
    assert "key" not in bad_junk and base64.b64decode(bad_junk["key_base64"]) == b"\xff\xfe"
    assert "expected Feedback, got Response" in wrong_type["error"]

    [turn] = read_all(tail_kafka, "chat.turns")
    assert turn["type"] == "ConversationTurn" and turn["value"]["finish_reason"] == "STOP"
    assert turn["value"]["prompt"] == "My cat is Pixel" and turn["value"]["completed_at"] == 1_700_000_000_500

    [dead] = read_all(tail_kafka, "chat.dlq")
    assert base64.b64decode(dead["value"]["value"]) == dead_value
    assert dead["value"]["headers"] == [{"key": "traceparent", "value": base64.b64encode(b"00-ab").decode()}]


def test_a_gateway_reply_topic_shows_chunks_and_embedding_results(tail_kafka, producer):
    """Guards against the EmbeddingResult of POST /v1/embeddings (it shares the reply topic with
    TokenChunk) being shown as an error line, while a third record type still is one."""
    topic = tail_kafka.topic("chat.replies.gw-1")
    producer.send(topic, TokenChunk(request_id="r1", conversation_id="c1", index=0, text="hi", worker_id="w"), key="r1")
    producer.send(topic, EmbeddingResult(request_id="r2", model="all-MiniLM-L6-v2", dimensions=2, count=1,
                                         vectors=b"\x00" * 8, tokens_in=3, worker_id="s"), key="r2")
    producer.send(topic, feedback("c1"), key="c1")
    producer.flush()
    chunk, embedding, wrong = sorted(read_all(tail_kafka, "chat.replies.gw-1"), key=lambda x: x["offset"])
    assert chunk["type"] == "TokenChunk" and chunk["value"]["text"] == "hi"
    assert embedding["type"] == "EmbeddingResult" and embedding["value"]["tokens_in"] == 3
    assert "expected TokenChunk or EmbeddingResult, got Feedback" in wrong["error"]


def test_partition_option_reads_only_that_partition(tail_kafka, producer):
    """Guards against --partition being ignored (every partition read) or mapping to another one."""
    for p in range(3):
        producer.send(tail_kafka.topic("chat.feedback"), feedback(f"c{p}"), key=f"c{p}", partition=p)
    producer.flush()
    lines = read_all(tail_kafka, "chat.feedback", partition=1)
    assert [(x["partition"], x["value"]["conversation_id"]) for x in lines] == [(1, "c1")]


def _start_tail(kafka, *args: str) -> subprocess.Popen:
    env = {**os.environ, "CHATPIPE_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
           "CHATPIPE_TOPIC_PREFIX": kafka.topic_prefix}
    proc = subprocess.Popen([CHATPIPE, "tail", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    ready = proc.stderr.readline()  # printed once the partitions are assigned at their start offsets
    assert ready.startswith("tailing "), ready + proc.stderr.read()
    return proc


def test_live_cli_prints_only_new_records_and_stops_cleanly_on_sigterm(tail_kafka, producer):
    """Guards against: the live mode replaying old records, missing one produced right after it
    started (a lazily resolved end offset), or dying on SIGTERM with a traceback / non-zero code."""
    producer.send(tail_kafka.topic("chat.feedback"), feedback("old"), key="old")
    producer.flush()
    proc = _start_tail(tail_kafka, "chat.feedback")
    try:
        producer.send(tail_kafka.topic("chat.feedback"), feedback("new1"), key="new1")
        producer.send(tail_kafka.topic("chat.feedback"), feedback("new2", FeedbackKind.THUMBS_DOWN), key="new2")
        producer.flush()
        lines = [json.loads(proc.stdout.readline()) for _ in range(2)]
        assert sorted(x["key"] for x in lines) == ["new1", "new2"]
        assert {x["value"]["kind"] for x in lines} == {"THUMBS_UP", "THUMBS_DOWN"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert proc.stdout.read() == ""  # "old" never shows up
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_cli_stops_quietly_when_the_reader_goes_away(tail_kafka, producer):
    """Guards against `chatpipe tail ... | head -1` ending in a BrokenPipeError traceback or
    tailing on forever after its reader has gone."""
    proc = _start_tail(tail_kafka, "chat.feedback")
    try:
        producer.send(tail_kafka.topic("chat.feedback"), feedback("a"), key="a")
        producer.flush()
        assert json.loads(proc.stdout.readline())["key"] == "a"
        proc.stdout.close()  # the reader leaves; the next write hits a closed pipe
        producer.send(tail_kafka.topic("chat.feedback"), feedback("b"), key="b")
        producer.flush()
        assert proc.wait(timeout=15) == 0
        assert proc.stderr.read() == ""
    finally:
        proc.kill()
        proc.wait()


def test_cli_max_and_timeout_end_a_from_beginning_read(tail_kafka, producer):
    """Guards against --max printing more (or fewer) lines than asked, and --timeout-s not ending
    a tail that has caught up."""
    for i in range(5):
        producer.send(tail_kafka.topic("chat.feedback"), feedback(f"m{i}"), key=f"m{i}", partition=0)
    producer.flush()
    env = {**os.environ, "CHATPIPE_BOOTSTRAP_SERVERS": tail_kafka.bootstrap_servers}
    args = [CHATPIPE, "tail", "chat.feedback", "--from-beginning", "--topic-prefix", tail_kafka.topic_prefix]
    limited = subprocess.run([*args, "--max", "2"], env=env, capture_output=True, text=True, timeout=60)
    assert limited.returncode == 0, limited.stderr
    assert [json.loads(x)["key"] for x in limited.stdout.splitlines()] == ["m0", "m1"]
    caught_up = subprocess.run([*args, "--timeout-s", "2"], env=env, capture_output=True, text=True, timeout=60)
    assert caught_up.returncode == 0, caught_up.stderr
    assert [json.loads(x)["key"] for x in caught_up.stdout.splitlines()] == [f"m{i}" for i in range(5)]


def test_cli_errors_are_one_line():
    """Guards against an unknown topic or a missing broker ending in a traceback, a page of
    librdkafka logs, or a wait of tens of seconds."""
    unknown = subprocess.run([CHATPIPE, "tail", "chat.nope"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 1 and unknown.stdout == ""
    assert len(unknown.stderr.strip().splitlines()) == 1
    assert all(spec.name in unknown.stderr for spec in CATALOG)

    start = time.monotonic()
    no_broker = subprocess.run([CHATPIPE, "tail", "chat.turns", "-b", f"127.0.0.1:{free_port()}"],
                               capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 20
    assert no_broker.returncode == 1 and no_broker.stdout == ""
    assert len(no_broker.stderr.strip().splitlines()) == 1 and "cannot reach Kafka" in no_broker.stderr
