"""EmbeddingRequest / EmbeddingResult (POST /v1/embeddings through Kafka): the records round-trip
through the codec, the vectors' bytes are little-endian float32 row-major (what OpenAI's base64
carries), and the input rules are the ones both tiers apply (schemas/embeddings.py)."""

from __future__ import annotations

import base64
import struct

import numpy as np
import pytest

from schemas.codec import HEADER_LEN, MARKER, default_codec
from schemas.embeddings import EMBEDDING_LIMITS, EmbeddingLimits, check_inputs, vector_bytes, vector_floats
from schemas.records import RECORD_TYPES, EmbeddingRequest, EmbeddingResult
from schemas.requests import RequestRuleError
from schemas.topics import EMBEDDING_REQUESTS, spec


def pack_rows(rows: list[list[float]]) -> bytes:
    """Vectors as ``EmbeddingResult.vectors``: float32, little-endian, row-major."""
    return b"".join(struct.pack(f"<{len(row)}f", *row) for row in rows)


def test_request_round_trip():
    codec = default_codec()
    request = EmbeddingRequest(tenant="acme", user_id="acme:ann", model="all-MiniLM-L6-v2",
                               inputs=["a cat", "ein Hund 🐕", ""], dimensions=384, reply_to="p.chat.replies.gw-1",
                               reply_partition=0, deadline_at=1_700_000_000_123)
    data = codec.encode(request)
    assert data[len(MARKER):HEADER_LEN] == codec.registry.latest("EmbeddingRequest").fingerprint
    assert codec.decode(data, EmbeddingRequest) == request
    bare = EmbeddingRequest(tenant="t", user_id="u", model="m", inputs=["x"], reply_to="r")
    decoded = codec.decode(codec.encode(bare), EmbeddingRequest)
    assert decoded == bare and decoded.dimensions is None and decoded.deadline_at is None


def test_result_round_trip_keeps_float32_exactly():
    codec = default_codec()
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((3, 384)).astype(np.float32)
    result = EmbeddingResult(request_id="r1", model="all-MiniLM-L6-v2", dimensions=384, count=3,
                             vectors=vectors.astype("<f4").tobytes(), tokens_in=17, worker_id="streams.embeddings")
    decoded = codec.decode(codec.encode(result), EmbeddingResult)
    assert decoded == result
    for i in range(3):
        assert np.array_equal(np.array(vector_floats(decoded.vectors, 384, i), dtype=np.float32), vectors[i])
        # OpenAI's base64: the vector's little-endian float32 bytes
        raw = base64.b64decode(base64.b64encode(vector_bytes(decoded.vectors, 384, i)))
        assert np.array_equal(np.frombuffer(raw, dtype="<f4"), vectors[i])
    assert pack_rows(vectors.tolist()) == result.vectors


def test_error_result_round_trip():
    codec = default_codec()
    result = EmbeddingResult(request_id="r2", model="gpt-x", worker_id="streams.embeddings",
                             error_code="model_not_found", error="no such model", error_param="model")
    decoded = codec.decode(codec.encode(result), EmbeddingResult)
    assert decoded == result and decoded.vectors == b"" and decoded.count == 0


def test_records_and_topic_are_in_the_catalogs():
    assert RECORD_TYPES["EmbeddingRequest"] is EmbeddingRequest
    assert RECORD_TYPES["EmbeddingResult"] is EmbeddingResult
    assert spec(EMBEDDING_REQUESTS).value == "EmbeddingRequest" and spec(EMBEDDING_REQUESTS).key == "request_id"


def test_vector_slices_are_bounded():
    data = pack_rows([[1.0, 2.0], [3.0, 4.0]])
    assert vector_floats(data, 2, 1) == [3.0, 4.0]
    for index in (2, -1):
        with pytest.raises(ValueError):
            vector_bytes(data, 2, index)


@pytest.mark.parametrize("inputs, field, code", [
    ([], "input", "invalid_value"),
    ([""], "input", "invalid_value"),
    (["ok", ""], "input[1]", "invalid_value"),
    (["x" * (EMBEDDING_LIMITS.max_input_chars + 1)], "input", "string_above_max_length"),
    (["x"] * (EMBEDDING_LIMITS.max_inputs + 1), "input", "array_above_max_length"),
    (["x" * EMBEDDING_LIMITS.max_input_chars] * (EMBEDDING_LIMITS.max_total_chars // EMBEDDING_LIMITS.max_input_chars
                                                 + 1), "input", "string_above_max_length"),
])
def test_input_rules(inputs, field, code):
    with pytest.raises(RequestRuleError) as err:
        check_inputs(inputs)
    assert err.value.field == field and err.value.code == code


def test_limits_fit_a_broker_message():
    check_inputs(["a text"] * EMBEDDING_LIMITS.max_inputs)
    assert EMBEDDING_LIMITS.worst_case_request_bytes() <= 0.9 * EMBEDDING_LIMITS.broker_message_bytes
    assert EMBEDDING_LIMITS.max_vectors(384) >= EMBEDDING_LIMITS.max_inputs  # all-MiniLM-L6-v2: all of them fit
    assert EMBEDDING_LIMITS.max_vectors(4096) < EMBEDDING_LIMITS.max_inputs  # a large model: streams refuses more
    with pytest.raises(ValueError):
        EmbeddingLimits(max_total_chars=1_000_000)
