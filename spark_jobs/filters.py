"""Quality filters over redacted turns: each turn is kept or dropped with the first reason that holds.

Reasons, checked in this order (step ``quality``):

- ``error_response``: finish reason ERROR, TIMEOUT or OVERLOADED, or an answer that opens
  like an error message ("Error:", "Traceback (most recent call last)", "Internal server error").
- ``incomplete``: finish reason CANCELLED (the client went away mid-answer). LENGTH answers
  are kept: truncated, but real.
- ``empty``: prompt or answer is only whitespace.
- ``too_short``: answer under ``min_answer_chars`` or prompt under ``min_prompt_chars``
  characters, whitespace stripped.
- ``too_long``: system prompt + prompt + answer over ``max_chars`` characters.
- ``mostly_non_text``: under ``min_text_ratio`` of the answer's characters are text. Text is
  letters (any script), ASCII digits, whitespace and the punctuation of ordinary prose
  (:data:`PROSE_PUNCT`: ``. , ; : ! ? ' " ( ) [ ] - / % $ & * # @ + = ~`` and typographic
  quotes, dashes, currency signs), so "In 2023, revenue rose 12.5% to $4.2M (Q3: 1,204 units)."
  is all text. Non-text: every character of a run of :data:`LONG_RUN_CHARS` or more characters
  without whitespace that is not a URL (base64 blobs, minified code, binary garbage), and any
  other symbol or control character (``{ } < > _ | \\ ^``, replacement characters, ...).
- ``repeated_lines``: over ``max_dup_line_ratio`` of the answer's non-empty lines repeat an
  earlier line (degenerate loops).

The rules are Spark Columns (:func:`tag_quality`); the single-process baseline's plain-Python
twin (``bench/finetune_reference.py``, ``quality_reason_py``) is checked against them by
``tests/spark/test_quality_text.py``. Not here: duplicates across turns (``dedup``), eval leaks
(``decontam``).
"""

from __future__ import annotations

import re

from spark_jobs.settings import FinetuneSettings

ERROR_FINISH = ("ERROR", "TIMEOUT", "OVERLOADED")
ERROR_TEXT = (
    r"(?i)^[ \t\n\r]*(error:|error [0-9]{3}|exception:|traceback \(most recent call last\)"
    r"|internal server error|an error occurred|sorry, something went wrong)"
)
WHITESPACE = " \t\n\r"

#: Punctuation that ordinary prose uses, counted as text by ``mostly_non_text``.
PROSE_PUNCT = ".,;:!?'\"()[]-/%$&*#@+=~\u20ac\u00a3\u00a5\u00b0\u2013\u2014\u2018\u2019\u201c\u201d\u2026"
#: A whitespace-free run this long is a blob, not words (the longest English words are ~30).
LONG_RUN_CHARS = 40
#: Same regex for Python and Java: whitespace-free runs of LONG_RUN_CHARS+ characters, unless
#: they hold ``://`` (a URL is text).
LONG_RUN = rf"(?<![^ \t\n\r])(?![^ \t\n\r]*://)[^ \t\n\r]{{{LONG_RUN_CHARS},}}"
#: Java class of the characters that are *not* text (``[`` ``]`` escaped: Java nests classes;
#: ``-`` escaped: no range).
_NON_TEXT_CLASS = "[^\\p{L}0-9" + WHITESPACE + re.sub(r"([\[\]\-])", r"\\\1", PROSE_PUNCT) + "]"


def text_char_count(answer, spark=None):
    """A Column: how many characters of ``answer`` are text (the module docstring says which);
    ``spark``: the session the column is for (default: the active one)."""
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from spark_jobs import jvm_functions

    spark = spark or SparkSession.getActiveSession()
    if spark is not None and jvm_functions.registered(spark):  # the same count in one pass (jvm_functions)
        return F.call_function(jvm_functions.TEXT_CHARS, answer, F.lit(PROSE_PUNCT), F.lit(LONG_RUN_CHARS))
    return F.length(F.regexp_replace(F.regexp_replace(answer, LONG_RUN, ""), _NON_TEXT_CLASS, ""))


def _measures(spark=None) -> dict:
    """The per-turn numbers the quality rules compare, as Columns by name."""
    from pyspark.sql import functions as F

    prompt, answer = F.coalesce(F.col("prompt"), F.lit("")), F.coalesce(F.col("answer"), F.lit(""))
    answer_len = F.length(answer)
    lines = F.filter(F.transform(F.split(answer, "\n"), lambda x: F.trim(x, F.lit(" \t\r"))), lambda x: x != "")
    return {
        "_q_prompt_chars": F.length(F.trim(prompt, F.lit(WHITESPACE))),
        "_q_answer_chars": F.length(F.trim(answer, F.lit(WHITESPACE))),
        "_q_answer_len": answer_len,
        "_q_total_len": F.length(F.coalesce(F.col("system_prompt"), F.lit(""))) + F.length(prompt) + answer_len,
        "_q_text_chars": text_char_count(answer, spark),
        "_q_lines": F.size(lines),
        "_q_distinct_lines": F.size(F.array_distinct(lines)),
    }


def _reason(s: FinetuneSettings, m: dict):
    """The first quality rule that holds, over the measures ``m`` (:func:`_measures`)."""
    from pyspark.sql import functions as F

    from spark_jobs.steps import first_reason

    answer = F.coalesce(F.col("answer"), F.lit(""))
    p_len, a_len = m["_q_prompt_chars"], m["_q_answer_chars"]
    dup_ratio = 1 - m["_q_distinct_lines"] / m["_q_lines"]
    return first_reason(
        (F.col("finish_reason").isin(*ERROR_FINISH) | answer.rlike(ERROR_TEXT), "error_response"),
        (F.col("finish_reason") == "CANCELLED", "incomplete"),
        ((p_len == 0) | (a_len == 0), "empty"),
        ((a_len < s.min_answer_chars) | (p_len < s.min_prompt_chars), "too_short"),
        (m["_q_total_len"] > s.max_chars, "too_long"),
        (m["_q_text_chars"] / m["_q_answer_len"] < s.min_text_ratio, "mostly_non_text"),
        ((m["_q_lines"] >= 2) & (dup_ratio > s.max_dup_line_ratio), "repeated_lines"),
    )


def tag_quality(df, s: FinetuneSettings, spark=None):
    """``df`` (tagged, ``steps.tag``) with its live turns that fail a quality rule dropped.

    The measures are columns of their own first, each computed once per turn: inside the rules'
    CASE WHEN, Spark evaluates a shared expression again in every branch that names it (the
    trims and lengths of prompt and answer were a large share of the step's CPU time).
    """
    from pyspark.sql import functions as F

    from spark_jobs.steps import tag

    m = _measures(spark)
    measured = df.select("*", *[col.alias(name) for name, col in m.items()])
    return tag(measured, "quality", _reason(s, {name: F.col(name) for name in m})).drop(*m)
