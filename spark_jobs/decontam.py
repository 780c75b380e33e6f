"""Decontamination: drop turns that share a long word n-gram with an eval set (step ``decontam``).

Eval files: ``.jsonl`` (every string value of every object is eval text) or any other text
file (one example per line). Text on both sides is normalised like the dedup key (lower
case, runs of non-letters/digits -> one space) and cut into word ``n``-grams (13 by default,
as in GPT-3's decontamination; pyspark.ml's ``NGram`` cuts them, see ``dedup.word_ngrams``).
The eval n-grams are hashed (xxhash64) into a small DataFrame that is broadcast; each turn's
n-gram hashes are exploded and joined against it (words from the text normalised once per
turn, ``dedup.norm_column``). Reason ``eval_contamination``, detail ``eval=<file name>`` (the
first file, by name, that it shares an n-gram with). A 64-bit hash collision could drop a clean turn (odds about
n-grams^2 / 2^64: nil at our sizes) but never keeps a leaked one.

Turns with fewer than ``n`` words cannot share an n-gram and pass.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from spark_jobs.dedup import norm_column, word_ngrams
from spark_jobs.errors import InputError
from spark_jobs.steps import is_live, tag

_NON_WORD = re.compile(r"[\W_]+")


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def eval_texts(path: Path) -> list[str]:
    """The eval examples in ``path`` (see module docstring for formats)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"eval file {path} does not exist")
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix != ".jsonl":
        return [line for line in lines if line.strip()]
    texts = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                texts.append(" ".join(_strings(json.loads(line))))
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{number}: not JSON: {exc}") from None
    return texts


def _words(df: DataFrame, key: str, text, n: int) -> DataFrame:
    """(``key``, _w): ``text`` normalised like the dedup key and split, rows of at least ``n`` words."""
    words = F.split(F.trim(F.regexp_replace(F.lower(text), r"[^\p{L}\p{N}]+", " ")), " ")
    return df.select(key, words.alias("_w")).where(F.size("_w") >= n)


def _ngram_hashes(words: DataFrame, key: str, n: int) -> DataFrame:
    """(``key``, h): one row per word ``n``-gram of ``_words`` rows, h its xxhash64."""
    grams = word_ngrams(words, "_w", n, "_g")
    return grams.select(key, F.explode("_g").alias("_gram")).select(key, F.xxhash64("_gram").alias("h"))


def eval_ngrams(spark: SparkSession, files: tuple[Path, ...], n: int) -> DataFrame:
    """One row per distinct (n-gram hash) with the first eval file name holding it."""
    rows = [(Path(f).name, text) for f in files for text in eval_texts(f)]
    words = _words(spark.createDataFrame(rows, "eval string, text string"), "eval", F.col("text"), n)
    return _ngram_hashes(words, "eval", n).groupBy("h").agg(F.min("eval").alias("eval"))


def decontaminate(df: DataFrame, spark: SparkSession, files: tuple[Path, ...], n: int) -> DataFrame:
    """``df`` (tagged, ``steps.tag``) with its live turns that share an n-gram with an eval file dropped."""
    if not files:
        return df
    evals = eval_ngrams(spark, files, n)
    words = F.split(norm_column(df), " ")
    hits = (
        _ngram_hashes(df.where(is_live()).select("event_id", words.alias("_w")).where(F.size("_w") >= n),
                      "event_id", n)
        .join(F.broadcast(evals), "h")
        .groupBy("event_id").agg(F.min("eval").alias("_eval"))
    )
    # Contaminated turns are few: broadcast them rather than shuffle every turn for the join.
    tagged = tag(df.join(F.broadcast(hits), "event_id", "left"), "decontam",
                 F.when(F.col("_eval").isNotNull(), F.lit("eval_contamination")),
                 F.concat(F.lit("eval="), F.col("_eval")))
    return tagged.drop("_eval")


def ngrams_py(text: str, n: int) -> set[str]:
    """The normalised word n-grams of ``text`` (plain-Python twin, for the baseline)."""
    words = _NON_WORD.sub(" ", text.lower()).strip().split(" ")
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}
