"""The gateway as part of the whole pipeline: memory across turns, cancels, backlog, several gateways.

Real processes throughout (streams, inference worker with the default model, gateways) on the
session broker; records are checked on the topics and in the archive.
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from chatpipe.testing.gateway import API_KEY, start_gateway
from chatpipe.testing.streams import Tap
from schemas.codec import default_codec
from schemas.records import Cancel, ConversationTurn, FinishReason, Response

pytestmark = [pytest.mark.integration, pytest.mark.model]
MODEL = "smollm2-135m-instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def ask(url: str, content: str, *, conversation: str | None = None, max_tokens: int = 8, timeout: float = 300,
        system: str | None = None, **extra) -> httpx.Response:
    headers = dict(AUTH)
    if conversation:
        headers["X-Chatpipe-Conversation-Id"] = conversation
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=timeout)


def test_a_fact_from_the_first_turn_is_recalled_ten_turns_later(pipeline):
    """Turn 1 tells a fact; ten turns later (far outside the 4 recent turns the context keeps) the
    answer must contain it, so it came from memory; every turn then appears on chat.turns and in
    the archive."""
    conversation = f"conv-{uuid.uuid4().hex[:8]}"
    # Memory is per tenant and user: a user of its own keeps other tests' turns out of recall.
    # The default model is tiny (135M): greedy, short answers and a direct question keep it on topic.
    turn = dict(conversation=conversation, system="Answer briefly.", user=f"user-{conversation}")
    first = ask(pipeline.url, "My cat is called Pixel.", max_tokens=16, **turn)
    assert first.status_code == 200, first.text
    assert first.headers["X-Chatpipe-Conversation-Id"] == conversation
    fillers = ["What is two plus two?", "Name a fruit.", "What colour is the sky?", "Say hello.", "Name a tree.",
               "What is the opposite of hot?", "Name a planet.", "Count to three.", "Name a flower."]
    for question in fillers:
        r = ask(pipeline.url, question, max_tokens=16, **turn)
        assert r.status_code == 200, r.text
    recall = ask(pipeline.url, "What is my cat called? Reply with just its name.", max_tokens=16, **turn)
    assert recall.status_code == 200, recall.text
    answer = recall.json()["choices"][0]["message"]["content"]
    assert "Pixel" in answer, f"the fact was not recalled: {answer!r}"

    request_ids = {first.headers["X-Chatpipe-Request-Id"], recall.headers["X-Chatpipe-Request-Id"]}
    tap = Tap(pipeline.kafka, "chat.turns")
    try:
        turns = tap.records(11, timeout_s=120, where=lambda t: t.conversation_id == conversation)
    finally:
        tap.close()
    assert sorted(t.turn_index for t in turns) == list(range(11))
    assert request_ids <= {t.request_id for t in turns}
    assert any("Pixel" in t.answer for t in turns if t.request_id == recall.headers["X-Chatpipe-Request-Id"])

    from transport.archive import read_messages

    codec, archived = default_codec(), set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(archived) < 11:
        archived = set()
        for path in sorted(pipeline.streams.archive_dir.rglob("*.avro")):
            for m in read_messages(path):
                record = codec.decode(m.value)
                if isinstance(record, ConversationTurn) and record.conversation_id == conversation:
                    archived.add(record.request_id)
        time.sleep(0.5)
    assert archived == {t.request_id for t in turns}, "the archive lacks turns that are on chat.turns"


def test_client_disconnect_cancels_the_generation(pipeline):
    """A streaming client that goes away mid-answer: a Cancel reaches chat.cancels and the worker
    stops early (its Response says CANCELLED), instead of generating all 400 tokens for nobody."""
    tap = Tap(pipeline.kafka, "chat.cancels", "chat.responses")
    try:
        body = {"model": MODEL, "stream": True, "max_tokens": 400, "temperature": 0.9,
                "messages": [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}]}
        with httpx.stream("POST", f"{pipeline.url}/v1/chat/completions", json=body, headers=AUTH, timeout=300) as r:
            assert r.status_code == 200
            request_id = r.headers["X-Chatpipe-Request-Id"]
            lines = r.iter_lines()
            seen = [next(lines) for _ in range(6)]  # a few events of the stream, then hang up
            assert any(line.startswith("data: ") for line in seen)
        cancel = tap.records(1, timeout_s=30, where=lambda x: isinstance(x, Cancel) and x.request_id == request_id)
        assert cancel[0].reason == "client_disconnected"
        response = tap.records(1, timeout_s=60,
                               where=lambda x: isinstance(x, Response) and x.request_id == request_id)[0]
        assert response.finish_reason is FinishReason.CANCELLED
        assert response.tokens_out < 400
    finally:
        tap.close()


def test_full_backlog_gets_429_and_a_second_gateway_reads_only_its_own_replies(pipeline, tmp_path):
    """A gateway allowing 1 request in flight answers the others 429 with Retry-After (OpenAI's
    error shape) while the first completes; each gateway's reply topic holds only its own requests."""
    small = start_gateway(pipeline.kafka, tmp_path, gateway_id="gw-small", CHATPIPE_GATEWAY_MAX_PENDING="1")
    try:
        small.wait_healthy(60)
        results: list[httpx.Response] = []

        def one(i: int) -> None:
            results.append(ask(small.url, f"Say the number {i}.", max_tokens=24))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(300)
        codes = sorted(r.status_code for r in results)
        assert codes.count(200) >= 1 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
        busy = next(r for r in results if r.status_code == 429)
        assert int(busy.headers["Retry-After"]) >= 1
        assert busy.json()["error"]["type"] == "rate_limit_error"
        ours = {r.headers["X-Chatpipe-Request-Id"] for r in results if r.status_code == 200}
        main_answer = ask(pipeline.url, "Say yes.")
        assert main_answer.status_code == 200
        theirs = {main_answer.headers["X-Chatpipe-Request-Id"]}

        # A refusal to a reply topic created after streams started, then a normal request: both
        # answered (streams' Faust producer once lost its changelog metadata after such a refusal).
        too_long = ask(small.url, "Tell me about the sea. " * 400)
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        after = ask(small.url, "Say the number 7.", max_tokens=8)
        assert after.status_code == 200, after.text
        ours.add(after.headers["X-Chatpipe-Request-Id"])

        small_topic = pipeline.kafka.topic("chat.replies.gw-small")
        on_small = reply_request_ids(pipeline.kafka, small_topic)
        assert ours <= on_small and not (on_small & theirs), "a gateway's reply topic holds others' tokens"
        assert small.terminate() == 0
    finally:
        if small.proc.poll() is None:
            small.proc.kill()


def reply_request_ids(kafka, topic: str) -> set[str]:
    consumer = Consumer({**kafka.client_config(), "group.id": "unused", "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    codec, ids = default_codec(), set()
    try:
        while batch := consumer.consume(500, 2.0):
            ids |= {codec.decode(m.value()).request_id for m in batch if m.error() is None}
    finally:
        consumer.close()
    return ids
