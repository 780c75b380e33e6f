"""POST /v1/embeddings through the real pipeline: the official ``openai`` client, the gateway, Kafka,
the streams worker embedding with memory's own model (no mocks).

Guards: the vectors a client gets are the ones memory computes for the same texts (the same
``streams.embeddings.Embedder`` with the same settings, here in the test process), as floats and
as base64; what streams refuses (model, dimensions, a text longer than the model reads) comes
back as OpenAI's 4xx and leaves a dead letter; bad input is a 400 at the gateway.

The stack is streams + gateway only, under a prefix of its own (no inference worker: embeddings
never reach one), so this module costs one streams start, not the chat model's load.
"""

from __future__ import annotations

import base64
import uuid

import numpy as np
import openai
import pytest

from chatpipe.testing.gateway import API_KEY

pytestmark = pytest.mark.integration
MODEL = "all-MiniLM-L6-v2"
TEXTS = ["The cat sat on the mat.", "Kafka keeps records in partitions.", "Der Hund bellt.", "🙂 emoji and ünïcode"]


@pytest.fixture(scope="module")
def stack(kafka_stack, tmp_path_factory):
    from chatpipe.testing.gateway import start_gateway
    from chatpipe.testing.streams import StreamsWorker
    from transport.admin import TopicAdmin
    from transport.settings import KafkaSettings

    kafka = KafkaSettings(bootstrap_servers=kafka_stack.bootstrap_servers, topic_prefix=f"e{uuid.uuid4().hex[:8]}.")
    TopicAdmin(kafka).apply()
    root = tmp_path_factory.mktemp("embeddings")
    (root / "streams").mkdir()
    streams = StreamsWorker(kafka, root / "streams")
    gateway = start_gateway(kafka, root)
    try:
        streams.start()
        gateway.wait_healthy(120)
    except BaseException:
        gateway.terminate()
        if streams.proc is not None and streams.proc.poll() is None:
            streams.stop()
        raise
    yield kafka, gateway, streams
    assert gateway.terminate() == 0
    assert streams.stop() == 0, streams.tail()


@pytest.fixture(scope="module")
def client(stack):
    _, gateway, _ = stack
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def memory_vectors():
    """The texts as memory embeds them: the streams tier's own Embedder, with the same settings."""
    from streams.embeddings import Embedder
    from streams.memory_settings import MemorySettings

    return Embedder(MemorySettings()).encode(TEXTS)


def _close(got, want) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape
    # Same model, dtype and normalisation: the same floats (seen: equal to the bit, batched or not);
    # the tolerance only allows a batch padded otherwise to move the last digits.
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert np.all(np.sum(got * want, axis=1) > 0.999)  # cosine: the same vectors


def test_openai_client_gets_memorys_vectors(client, memory_vectors):
    answer = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    assert answer.model == MODEL and [d.index for d in answer.data] == list(range(len(TEXTS)))
    _close([d.embedding for d in answer.data], memory_vectors)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > len(TEXTS)

    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    _close([d.embedding for d in floats.data], memory_vectors)
    assert np.array_equal(np.array([d.embedding for d in floats.data], dtype=np.float32),
                          np.array([d.embedding for d in answer.data], dtype=np.float32))  # one batch, same bytes

    b64 = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    _close([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in b64.data], memory_vectors)

    one = client.embeddings.create(model=MODEL.lower(), input=TEXTS[0], encoding_format="float", dimensions=384)
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384
    _close([one.data[0].embedding], memory_vectors[:1])


def test_refusals_of_streams_are_4xx_and_dead_letters(stack, client):
    from chatpipe.testing.streams import Tap
    from schemas.topics import DLQ, EMBEDDING_REQUESTS

    kafka, _, _ = stack
    with pytest.raises(openai.NotFoundError) as err:
        client.embeddings.create(model="text-embedding-3-small", input=["x"])
    assert err.value.body["code"] == "model_not_found" and MODEL in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=MODEL, input=["x"], dimensions=100)
    assert err.value.body["param"] == "dimensions" and "384" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=MODEL, input=["short", "word " * 400])
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "input[1]"

    tap = Tap(kafka, DLQ)
    try:
        letters = tap.records(3, timeout_s=30, where=lambda r: r.component == "streams.embeddings")
    finally:
        tap.close()
    assert {letter.error_type for letter in letters} == {"InvalidEmbeddingRequestError"}
    assert all(letter.source_topic == kafka.topic(EMBEDDING_REQUESTS) for letter in letters)


def test_bad_input_is_a_400_at_the_gateway(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=MODEL, input=[[101, 2023, 102]])  # token ids
    assert err.value.body["param"] == "input" and "token ids" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=MODEL, input=["fine", ""])
    assert err.value.body["param"] == "input[1]"


def test_records_from_any_producer_are_answered_or_dead_lettered(stack, memory_vectors):
    """Straight onto the topic, as an application would: served to its own reply topic; a passed
    deadline answered expired; an address nobody can answer, or bytes that do not decode: dead letters."""
    from chatpipe.testing.kafka import RecordWriter
    from chatpipe.testing.streams import Tap
    from schemas.records import EmbeddingRequest, EmbeddingResult, now_ms
    from schemas.topics import DLQ, EMBEDDING_REQUESTS
    from transport.admin import TopicAdmin

    kafka, _, _ = stack
    reply_to = kafka.topic("app.embedding.replies")
    TopicAdmin(kafka).create_topic(reply_to, 2, None)
    ok = EmbeddingRequest(tenant="acme", user_id="app", model=MODEL, inputs=TEXTS[:2], reply_to=reply_to,
                          reply_partition=1)
    late = EmbeddingRequest(tenant="acme", user_id="app", model=MODEL, inputs=["x"], reply_to=reply_to,
                            reply_partition=1, deadline_at=now_ms() - 1000)
    lost = EmbeddingRequest(tenant="acme", user_id="app", model=MODEL, inputs=["x"], reply_to=reply_to,
                            reply_partition=5)  # the topic has 2 partitions
    with RecordWriter(kafka) as producer:
        for record in (ok, late, lost):
            producer.send(kafka.topic(EMBEDDING_REQUESTS), record, key=record.request_id)
        producer.send_bytes(kafka.topic(EMBEDDING_REQUESTS), b"not avro", key=b"junk")
        producer.flush()

    consumer_tap = _ReplyTap(kafka, reply_to)
    try:
        results = {r.request_id: r for r in consumer_tap.records(2)}
    finally:
        consumer_tap.close()
    assert isinstance(results[ok.request_id], EmbeddingResult) and results[ok.request_id].error_code is None
    served = results[ok.request_id]
    got = np.frombuffer(served.vectors, dtype="<f4").reshape(served.count, served.dimensions)
    _close(got, memory_vectors[:2])
    assert results[late.request_id].error_code == "expired" and results[late.request_id].count == 0

    tap = Tap(kafka, DLQ)
    try:
        letters = tap.records(3, timeout_s=30, where=lambda r: r.component == "streams.embeddings"
                              and r.error_type in ("ExpiredRequestError", "InvalidReplyAddressError", "DecodeError"))
    finally:
        tap.close()
    assert sorted(letter.error_type for letter in letters) == ["DecodeError", "ExpiredRequestError",
                                                               "InvalidReplyAddressError"]


class _ReplyTap:
    """Both partitions of an application's own reply topic, from the start."""

    def __init__(self, kafka, topic: str) -> None:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        from schemas.codec import default_codec

        self.consumer = Consumer({**kafka.client_config(), "group.id": "unused", "enable.auto.commit": False})
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(2)])
        self.codec = default_codec()

    def records(self, n: int, timeout_s: float = 60.0) -> list:
        import time

        got, deadline = [], time.monotonic() + timeout_s
        while len(got) < n and time.monotonic() < deadline:
            got += [self.codec.decode(m.value()) for m in self.consumer.consume(10, 0.5) if m.error() is None]
        assert len(got) >= n, f"{len(got)} of {n} results within {timeout_s:g} s"
        return got

    def close(self) -> None:
        self.consumer.close()
