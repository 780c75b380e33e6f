"""Decontamination: drop turns that share a long word n-gram with an eval set (step ``decontam``).

Eval files: ``.jsonl`` (every string value of every object is eval text) or any other text
file (one example per line). Text on both sides is normalised like the dedup key (lower
case, runs of non-letters/digits -> one space) and cut into word ``n``-grams (13 by default,
as in GPT-3's decontamination). The eval n-grams are hashed (xxhash64) into a small DataFrame
that is broadcast; each turn's n-gram hashes are exploded and joined against it (the text
normalised once per turn, ``dedup.norm_column``). The hashes come from the project's Java
function ``chatpipe_ngram_xxhash64`` (``jvm_functions``: each n-gram hashed in place) or, without
it, from pyspark.ml's ``NGram`` + ``xxhash64`` (``dedup.word_ngrams``): the same values.

Reason ``eval_contamination``, detail ``eval=<file name>`` (the first file, by name, that it
shares an n-gram with). A 64-bit hash collision could drop a clean turn (odds about
n-grams^2 / 2^64: nil at our sizes) but never keeps a leaked one.

Turns with fewer than ``n`` words cannot share an n-gram and pass.
"""

from __future__ import annotations

import json
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from spark_jobs import jvm_functions
from spark_jobs.dedup import norm_column, normalize, word_ngrams
from spark_jobs.errors import InputError
from spark_jobs.steps import is_live, tag


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


def _ngram_hashes(df: DataFrame, key: str, norm, n: int) -> DataFrame:
    """(``key``, h): one row per word ``n``-gram of the normalised text ``norm``, h its xxhash64
    (no rows for a text under ``n`` words)."""
    if jvm_functions.registered(df.sparkSession):  # the same hashes, without a row per n-gram string first
        hashes = F.call_function(jvm_functions.NGRAM_XXHASH64, norm.cast("binary"), F.lit(n))
        return df.select(key, F.explode(hashes).alias("h"))
    words = df.select(key, F.split(norm, " ").alias("_w")).where(F.size("_w") >= n)
    grams = word_ngrams(words, "_w", n, "_g")
    return grams.select(key, F.explode("_g").alias("_gram")).select(key, F.xxhash64("_gram").alias("h"))


def eval_ngrams(spark: SparkSession, files: tuple[Path, ...], n: int) -> DataFrame:
    """One row per distinct (n-gram hash) with the first eval file name holding it."""
    rows = [(Path(f).name, text) for f in files for text in eval_texts(f)]
    texts = spark.createDataFrame(rows, "eval string, text string")
    return _ngram_hashes(texts, "eval", normalize(F.col("text")), n).groupBy("h").agg(F.min("eval").alias("eval"))


def decontaminate(df: DataFrame, spark: SparkSession, files: tuple[Path, ...], n: int,
                  hashed: DataFrame | None = None) -> DataFrame:
    """``df`` (tagged, ``steps.tag``) with its live turns that share an n-gram with an eval file dropped.

    ``hashed``: a frame whose live rows include ``df``'s (default ``df``) to look for eval n-grams
    in. The job passes the turns *before* the quality step: the look-up then does not depend on
    the quality expressions, which Spark would otherwise evaluate twice (once for this look-up,
    once for the frame it is joined back to; measured: ~15 s of CPU at 200k turns). Rows only
    ``hashed`` has are never tagged: the tag goes to ``df``'s live rows.
    """
    if not files:
        return df
    hashed = df if hashed is None else hashed
    evals = eval_ngrams(spark, files, n)
    hits = (
        _ngram_hashes(hashed.where(is_live()), "event_id", norm_column(hashed), n)
        .join(F.broadcast(evals), "h")
        .groupBy("event_id").agg(F.min("eval").alias("_eval"))
    )
    # Contaminated turns are few: broadcast them rather than shuffle every turn for the join.
    tagged = tag(df.join(F.broadcast(hits), "event_id", "left"), "decontam",
                 F.when(F.col("_eval").isNotNull(), F.lit("eval_contamination")),
                 F.concat(F.lit("eval="), F.col("_eval")))
    return tagged.drop("_eval")
