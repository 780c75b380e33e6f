"""POST /v1/embeddings in this process, no Kafka (the shapes; the pipeline is test_embeddings.py's).

The producer answers each EmbeddingRequest at once with vectors the test chose, put on the
request's reply queue as the reply reader would; the official ``openai`` client reads them.
"""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import openai
import pytest
from starlette.testclient import TestClient

from schemas.embeddings import EMBEDDING_LIMITS
from schemas.records import EmbeddingRequest, EmbeddingResult
from tests.gateway.inprocess import QueueReader

API_KEY = "sk-embeddings-test"
MODEL = "all-MiniLM-L6-v2"
DIM = 8


def vectors_for(texts: list[str]) -> np.ndarray:
    """A deterministic [len(texts), DIM] float32 per text (not round numbers: exactness is tested)."""
    rows = [np.random.default_rng(abs(hash(t)) % 2**32).standard_normal(DIM) for t in texts]
    return np.asarray(rows, dtype=np.float32)


class EmbeddingProducer:
    def __init__(self, service) -> None:
        self.service = service
        self.sent: list = []

    def send(self, topic, record, *, want_ack=True, **_):
        self.sent.append((topic, record))
        loop = asyncio.get_running_loop()
        if isinstance(record, EmbeddingRequest):
            queue = self.service.reader.queues[record.request_id]
            if record.model != MODEL:
                result = EmbeddingResult(request_id=record.request_id, model=record.model, worker_id="t",
                                         error_code="model_not_found", error=f"no model {record.model}",
                                         error_param="model")
            else:
                result = EmbeddingResult(request_id=record.request_id, model=MODEL, dimensions=DIM,
                                         count=len(record.inputs), vectors=vectors_for(record.inputs).tobytes(),
                                         tokens_in=3 * len(record.inputs), worker_id="t")
            loop.call_soon(queue.put_nowait, result)
        future = loop.create_future()
        future.set_result(None)
        return future

    def close(self, *_):
        pass


@pytest.fixture
def client(tmp_path):
    from gateway.app import create_app
    from gateway.keys import KeyStore
    from gateway.settings import GatewaySettings
    from transport.settings import KafkaSettings

    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({API_KEY: {"tenant": "acme", "users": "any"}}))
    app = create_app(KafkaSettings(topic_prefix="p."), GatewaySettings(keys_file=keys_file), KeyStore.load(keys_file))
    service = app.state.service
    service.reply_topic, service.reader = "p.chat.replies.gw", QueueReader()
    service.producer = EmbeddingProducer(service)
    http = TestClient(app, base_url="http://testserver", headers={"Authorization": f"Bearer {API_KEY}"})
    http.producer = service.producer
    return http


def test_openai_client_float_and_base64(client):
    oa = openai.OpenAI(base_url="http://testserver/v1", api_key=API_KEY, http_client=client, max_retries=0)
    texts = ["a cat", "a dog", "the sea"]
    expected = vectors_for(texts)
    # Left out, the client asks for base64 and decodes it itself; asked for, it hands the base64 text on.
    for fmt in ("float", "base64", openai.NOT_GIVEN):
        answer = oa.embeddings.create(model=MODEL, input=texts, encoding_format=fmt)
        assert answer.object == "list" and answer.model == MODEL
        assert [d.index for d in answer.data] == [0, 1, 2]
        got = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") if fmt == "base64" else d.embedding
               for d in answer.data]
        assert np.array_equal(np.array(got, dtype=np.float32), expected)
        assert answer.usage.prompt_tokens == answer.usage.total_tokens == 9
    topic, record = client.producer.sent[-1]
    assert topic == "p.chat.embeddings.requests" and record.inputs == texts and record.reply_to == "p.chat.replies.gw"
    assert record.tenant == "acme" and record.deadline_at > record.created_at


def test_raw_shapes(client):
    body = client.post("/v1/embeddings", json={"model": MODEL, "input": "one text", "encoding_format": "base64",
                                               "user": "ann"}).json()
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert np.array_equal(np.frombuffer(raw, dtype="<f4"), vectors_for(["one text"])[0])
    assert client.producer.sent[-1][1].user_id.endswith(":ann")  # the key's namespace, as for chat
    plain = client.post("/v1/embeddings", json={"model": MODEL, "input": ["x"]}).json()
    assert isinstance(plain["data"][0]["embedding"], list) and len(plain["data"][0]["embedding"]) == DIM


@pytest.mark.parametrize("body, param, code", [
    ({"input": [1, 2, 3]}, "input", "invalid_value"),  # token ids
    ({"input": [[1, 2], [3]]}, "input", "invalid_value"),
    ({"input": []}, "input", "invalid_value"),
    ({"input": ""}, "input", "invalid_value"),
    ({"input": ["ok", ""]}, "input[1]", "invalid_value"),
    ({"input": ["ok", 3]}, "input[1]", "invalid_type"),
    ({"input": {"text": "x"}}, "input", "invalid_type"),
    ({"input": ["x"] * (EMBEDDING_LIMITS.max_inputs + 1)}, "input", "array_above_max_length"),
    ({"input": "x" * (EMBEDDING_LIMITS.max_input_chars + 1)}, "input", "string_above_max_length"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "invalid_value"),
    ({"input": "x", "dimensions": 0}, "dimensions", "invalid_value"),
    ({"input": "x", "user": "a\nb"}, "user", "invalid_value"),
    ({"input": "x", "temperature": 1}, "temperature", "unknown_parameter"),
])
def test_bad_input_is_a_400_before_anything_is_produced(client, body, param, code):
    reply = client.post("/v1/embeddings", json={"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["code"] == code and error["type"] == "invalid_request_error"
    assert not client.producer.sent


def test_missing_input_and_auth(client):
    assert client.post("/v1/embeddings", json={"model": MODEL}).status_code == 400
    reply = client.post("/v1/embeddings", json={"model": MODEL, "input": "x"}, headers={"Authorization": "Bearer no"})
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"


def test_a_refusal_from_streams_is_answered_in_openai_shape(client):
    reply = client.post("/v1/embeddings", json={"model": "text-embedding-3-small", "input": "x"})
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "model_not_found" and reply.json()["error"]["param"] == "model"
    assert not client.app.state.embeddings.inflight
