"""Decontamination: drop turns that share a long word n-gram with an eval set (step ``decontam``).

Eval files: ``.jsonl`` (every string value of every object is eval text) or any other text
file (one example per line). Text on both sides is normalised like the dedup key (lower
case, runs of non-letters/digits -> one space) and cut into word ``n``-grams (13 by default,
as in GPT-3's decontamination). The eval n-grams are hashed (xxhash64) into a small
DataFrame that is broadcast; each turn's n-gram hashes are exploded and semi-joined against
it. Reason ``eval_contamination``, detail ``eval=<file name>`` (the first file, by name,
that it shares an n-gram with). A 64-bit hash collision could drop a clean turn (odds about
n-grams^2 / 2^64: nil at our sizes) but never keeps a leaked one.

Turns with fewer than ``n`` words cannot share an n-gram and pass.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from spark_jobs.dedup import normalized_text
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


def _ngrams(words, n: int):
    return F.transform(F.sequence(F.lit(0), F.size(words) - n),
                       lambda i: F.xxhash64(F.array_join(F.slice(words, i + 1, n), " ")))


def eval_ngrams(spark: SparkSession, files: tuple[Path, ...], n: int) -> DataFrame:
    """One row per distinct (n-gram hash) with the first eval file name holding it."""
    rows = [(Path(f).name, text) for f in files for text in eval_texts(f)]
    df = spark.createDataFrame(rows, "eval string, text string")
    words = F.split(F.trim(F.regexp_replace(F.lower("text"), r"[^\p{L}\p{N}]+", " ")), " ")
    return (
        df.where(F.size(words) >= n)
        .select("eval", F.explode(_ngrams(words, n)).alias("h"))
        .groupBy("h").agg(F.min("eval").alias("eval"))
    )


def decontaminate(df: DataFrame, spark: SparkSession, files: tuple[Path, ...], n: int) -> DataFrame:
    """``df`` (tagged, ``steps.tag``) with its live turns that share an n-gram with an eval file dropped."""
    if not files:
        return df
    evals = eval_ngrams(spark, files, n)
    words = F.split(normalized_text(), " ")
    hits = (
        df.where(is_live() & (F.size(words) >= n))
        .select("event_id", F.explode(_ngrams(words, n)).alias("h"))
        .join(F.broadcast(evals), "h")
        .groupBy("event_id").agg(F.min("eval").alias("_eval"))
    )
    tagged = tag(df.join(hits, "event_id", "left"), "decontam",
                 F.when(F.col("_eval").isNotNull(), F.lit("eval_contamination")),
                 F.concat(F.lit("eval="), F.col("_eval")))
    return tagged.drop("_eval")


def ngrams_py(text: str, n: int) -> set[str]:
    """The normalised word n-grams of ``text`` (plain-Python twin, for the baseline)."""
    words = _NON_WORD.sub(" ", text.lower()).strip().split(" ")
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}
