"""The rules of an embedding request, and the vectors' wire format: what the gateway and streams share.

For: the bounds of ``EmbeddingRequest.inputs`` (``EMBEDDING_LIMITS``, ``check_inputs``: the
gateway checks them before producing, streams again on taking the record, the same code), and
the layout of ``EmbeddingResult.vectors``: ``count`` x ``dimensions`` float32, little-endian,
row-major, which is also each vector's bytes in OpenAI's ``encoding_format: base64``
(``vector_bytes``, ``vector_floats``; streams packs a numpy array: ``array.astype('<f4').tobytes()``).
Not for: the model's own limits (its dimension, its longest input in tokens): streams knows them
(streams/embedding_requests.py).

No I/O, no numpy: the gateway decodes vectors with the standard library.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from schemas.requests import RequestRuleError, over_limit

FLOAT_BYTES = 4  # float32


@dataclass(frozen=True, slots=True)
class EmbeddingLimits:
    """The bounds of one embedding request; ``EMBEDDING_LIMITS`` is what every tier uses.

    The request must fit one Kafka record (4 UTF-8 bytes per character at worst), and so must its
    result: ``max_inputs`` vectors of the model's dimension as float32 (streams refuses a request
    whose vectors would not fit, naming the count that does)."""

    max_inputs: int = 256  # OpenAI takes 2048; 256 vectors of 384 floats are 393 KB of result
    max_input_chars: int = 20_000  # one text (the model reads far fewer tokens: streams refuses longer)
    max_total_chars: int = 200_000  # all texts together
    broker_message_bytes: int = 1_048_576  # Kafka's default message.max.bytes

    def __post_init__(self) -> None:
        if self.worst_case_request_bytes() > 0.9 * self.broker_message_bytes:
            raise ValueError(f"an embedding request at these limits could encode to {self.worst_case_request_bytes()} "
                             f"bytes, over 90% of the broker's {self.broker_message_bytes}: lower max_total_chars")

    def worst_case_request_bytes(self) -> int:
        """An upper bound of the encoded EmbeddingRequest: 4 bytes a character, a few per input, ids."""
        return 4 * self.max_total_chars + 8 * self.max_inputs + 4096

    def max_vectors(self, dimensions: int) -> int:
        """Most vectors of ``dimensions`` floats one EmbeddingResult carries within 90% of a broker message."""
        return max(1, int(0.9 * self.broker_message_bytes - 4096) // (FLOAT_BYTES * max(1, dimensions)))


EMBEDDING_LIMITS = EmbeddingLimits()


def check_inputs(inputs: Sequence[str], limits: EmbeddingLimits = EMBEDDING_LIMITS) -> None:
    """At least one text, at most ``max_inputs``, none empty, each and all together within the
    character limits. Raises ``RequestRuleError`` whose field is OpenAI's param (``input``, ``input[3]``).
    Every input is a string already (the gateway's body checks that; an Avro record carries strings)."""
    if not inputs:
        raise RequestRuleError("input", "is empty: send a string or a list of at least one string")
    if len(inputs) > limits.max_inputs:
        raise over_limit("input", f"has {len(inputs)} texts", limits.max_inputs, "send them in several requests",
                         per="per request", code="array_above_max_length")
    total = 0
    for i, text in enumerate(inputs):
        field = "input" if len(inputs) == 1 else f"input[{i}]"
        if not text:
            raise RequestRuleError(field, "is an empty string: there is nothing to embed")
        if len(text) > limits.max_input_chars:
            raise over_limit(field, f"is {len(text)} characters", limits.max_input_chars, "shorten it", per="per text")
        total += len(text)
    if total > limits.max_total_chars:
        raise over_limit("input", f"is {total} characters in all", limits.max_total_chars,
                         "send fewer or shorter texts")


def vector_bytes(vectors: bytes, dimensions: int, index: int) -> bytes:
    """Vector ``index``'s bytes: ``dimensions`` little-endian float32 (what OpenAI's base64 encodes)."""
    size = FLOAT_BYTES * dimensions
    if dimensions <= 0 or (index + 1) * size > len(vectors) or index < 0:
        raise ValueError(f"no vector {index} of {dimensions} floats in {len(vectors)} bytes")
    return vectors[index * size:(index + 1) * size]


def vector_floats(vectors: bytes, dimensions: int, index: int) -> list[float]:
    """Vector ``index`` as Python floats (each exactly its float32 value)."""
    return list(struct.unpack(f"<{dimensions}f", vector_bytes(vectors, dimensions, index)))

