"""``mostly_non_text``: prose with numbers and punctuation is text; blobs and symbol soup are not;
the Python and Spark paths give the same verdict on every case (one Spark job)."""

from __future__ import annotations

import random

import pytest

from bench.finetune_reference import quality_reason_py, text_ratio
from spark_jobs.settings import FinetuneSettings

pytestmark = pytest.mark.spark

#: Ordinary answers, dense in digits and punctuation; the old rule (letters + whitespace only)
#: put each of these under 0.6 and dropped it.
PROSE = [
    "In 2023, revenue rose 12.5% to $4.2M (Q3: 1,204 units).",
    "| Quarter | Units | Growth |\n|---|---:|---:|\n| Q1 2024 | 1,204 | +12.5% |\n| Q2 2024 | 1,377 | +14.4% |",
    "2 + 2 = 4; 3 * 7 = 21; 10 / 4 = 2.5; 2^10 = 1024.",
    "Flight BA117: dep. 08:35 (T5), arr. 11:20 -- gate B32, seat 14C.",
    "Totals: €1.199,00 (Jan), €1.305,50 (Feb), €987,25 (Mar) = €3.491,75.",
    "Scores — 98.6, 102.4, 99.1 (avg 100.03 ± 1.7) on 2024-01-15/16.",
]

#: Ordinary answers that were text before and must stay text (code, prose, a URL list).
KEPT_TOO = [
    "Steps: 1) 250 g flour; 2) 2 eggs; 3) 300 ml milk; 4) bake 25-30 min at 180°C.",
    "“Yes” — it’s 3.5× faster: 120 ms → 34 ms (p95), see #4521 & @ops.",
    "def add(a, b):\n    \"\"\"Return the sum.\"\"\"\n    return a + b\n\nprint(add(2, 3))  # 5",
    "See https://docs.python.org/3/library/re.html#regular-expression-syntax and "
    "https://docs.oracle.com/en/java/javase/17/docs/api/java.base/java/util/regex/Pattern.html for details.",
    "The quick brown fox jumps over the lazy dog, twice.",
]


def _junk() -> list[str]:
    rng = random.Random(7)
    b64 = "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/", k=304))
    return [
        "data: " + "".join(rng.choices("0123456789+/=-_{}[]", k=300)),  # the planted case
        "Here it is:\n" + "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76)),  # base64 blob
        " ".join("".join(rng.choices("{}<>|^_\\`", k=6)) for _ in range(40)),  # symbol soup with spaces
        "".join(chr(rng.randrange(256)) for _ in range(400)),  # binary bytes read as Latin-1
        "\ufffd\x00\x01" * 60 + " ok",  # replacement and control characters
        "!function(e,t){var n={};function r(o){if(n[o])return n[o].exports}r.m=e,r.c=n}([]);" * 4,  # minified
        "<<<>>> ||| ___ ^^^ {{{ }}} \\\\\\ " * 12,
    ]


def _settings() -> FinetuneSettings:
    return FinetuneSettings(out="unused")  # only the quality thresholds (defaults) matter here


def _turn(answer: str) -> dict:
    return {"prompt": "What are the numbers?", "answer": answer, "system_prompt": None, "finish_reason": "STOP"}


def test_prose_with_numbers_is_text():
    """Catches the filter counting the digits and punctuation of ordinary prose as non-text."""
    s = _settings()
    for answer in PROSE + KEPT_TOO:
        assert text_ratio(answer) >= s.min_text_ratio, answer
        assert quality_reason_py(_turn(answer), s) is None, answer
    letters_only = [a for a in PROSE if sum(c.isalpha() or c in " \t\n\r" for c in a) / len(a) < s.min_text_ratio]
    assert letters_only == PROSE  # each case really is one the old letters+whitespace rule dropped


def test_blobs_and_symbol_soup_are_non_text():
    """Catches junk (base64, binary, minified code, symbol soup) slipping through as text."""
    s = _settings()
    for answer in _junk():
        assert quality_reason_py(_turn(answer), s) == "mostly_non_text", repr(answer[:60])


def test_spark_gives_the_python_verdict(spark):
    """Catches the Spark column and the Python function disagreeing on what is text (Java's
    ``\\p{L}`` vs ``str.isalpha``, the long-run regex, escaping in the character class)."""
    from spark_jobs.filters import tag_quality
    from spark_jobs.steps import untagged

    s = _settings()
    answers = PROSE + KEPT_TOO + _junk()
    df = spark.createDataFrame([(i, "What are the numbers?", a, None, "STOP") for i, a in enumerate(answers)],
                               "i int, prompt string, answer string, system_prompt string, finish_reason string")
    got = {r["i"]: r["_reason"] for r in tag_quality(untagged(df), s, spark).select("i", "_reason").collect()}
    want = {i: quality_reason_py(_turn(a), s) for i, a in enumerate(answers)}
    assert got == want
    assert set(want.values()) == {None, "mostly_non_text"}
