"""One message, one verdict: the Spark decode step and the Python codec accept and reject the same bytes.

The streams services decode with ``schemas.codec`` and the Spark jobs with ``from_avro`` in the
JVM; a message one accepts and the other rejects would be a turn in the dataset that the
pipeline dead-lettered (or the reverse). The cases are valid messages of both schema versions
and, from a seeded generator, their corruptions: truncated, trailing bytes, flipped bytes and
random bodies behind a valid header. All cases go through ONE Spark job.
"""

from __future__ import annotations

import random

import pytest

from chatpipe.testing.synthetic_log import encode_turn, generate
from schemas.codec import HEADER_LEN, AvroCodec
from schemas.errors import DecodeError
from schemas.records import ConversationTurn

pytestmark = pytest.mark.spark


def _cases(seed: int = 20261130) -> list[tuple[str, bytes]]:
    """(kind, value): valid turns (v1 and v2) and ~400 seeded corruptions of them."""
    rng = random.Random(seed)
    log = generate(n_turns=24, seed=3, planted=False, v1_share=0.5)
    codec = AvroCodec(validate_on_encode=False)
    valid = [encode_turn(codec, t, t.event_id in log.v1_event_ids) for t in log.turns]
    cases = [("valid", v) for v in valid]
    for i in range(100):
        v = valid[i % len(valid)]
        cases.append(("truncated", v[:rng.randrange(len(v))]))
        tail = rng.choice([b"\x00", b"\x02", bytes([rng.randrange(256)]), rng.randbytes(rng.randint(1, 12))])
        cases.append(("trailing", v + tail))
        flipped = bytearray(v)
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(HEADER_LEN, len(v)) if rng.random() < 0.9 else rng.randrange(len(v))
            flipped[pos] ^= rng.randrange(1, 256)
        cases.append(("flipped", bytes(flipped)))
        cases.append(("random body", v[:HEADER_LEN] + rng.randbytes(rng.randint(0, 120))))
    return cases


def _python_accepts(codec: AvroCodec, value: bytes) -> bool:
    try:
        codec.decode(value, ConversationTurn)
    except DecodeError:
        return False
    return True


def test_spark_and_python_codec_give_every_message_the_same_verdict(spark):
    """Catches the Spark decode step accepting what the Python codec rejects, or the reverse
    (trailing bytes after the body, invalid UTF-8 in a string, any corruption from_avro reads past)."""
    from spark_jobs.decode import decode_tagged
    from spark_jobs.sources import RAW_SCHEMA

    cases = _cases()
    codec = AvroCodec()
    expected = [_python_accepts(codec, v) for _, v in cases]
    assert sum(expected) >= 24 and len(expected) - sum(expected) >= 300  # both verdicts well represented
    raw = spark.createDataFrame([("chat.turns", 0, i, 0, None, bytearray(v)) for i, (_, v) in enumerate(cases)],
                                RAW_SCHEMA)
    rows = decode_tagged(raw, "ConversationTurn").select("source_offset", "_reason").collect()
    spark_reason = {r.source_offset: r._reason for r in rows}
    assert len(spark_reason) == len(cases)
    differ = [(i, kind, expected[i], spark_reason[i], cases[i][1].hex())
              for i, (kind, _) in enumerate(cases) if expected[i] != (spark_reason[i] is None)]
    assert differ == [], f"{len(differ)} verdicts differ (index, kind, python accepts, spark reason, hex): {differ[:5]}"
    trailing = [spark_reason[i] for i, (kind, _) in enumerate(cases) if kind == "trailing"]
    assert set(trailing) == {"corrupt_body"}, "trailing bytes must be dropped like a corrupt body"
