"""The project's Java functions (``spark_jobs/jvm_functions.py``) compute what the Spark SQL path computes.

They replace Spark SQL expressions for speed only: the n-gram hashes and MinHash signatures must be
equal value for value, and the job's outputs byte for byte, with and without them.
"""

from __future__ import annotations

import filecmp
import random

import pytest

from spark_jobs import jvm_functions

pytestmark = pytest.mark.spark

WORDS = ["the", "a", "capital", "of", "france", "is", "paris", "über", "straße", "日本語", "テスト", "ñ", "2026",
         "x1", "naïve", "😀", "e", "résumé"]


def _texts(n: int, seed: int = 5) -> list[str]:
    """Normalised texts as the job stores them (one space between words): empty, one word, short, long."""
    rng = random.Random(seed)
    texts = ["", "paris", "a b", "é", " ".join(WORDS)]
    for _ in range(n):
        texts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 40))))
    return texts


@pytest.fixture
def sql_only(spark):
    """The session with the functions dropped (the Spark SQL path), registered again afterwards."""
    assert jvm_functions.registered(spark), "the session fixture must have the functions (javac is on this machine)"
    for name in jvm_functions.FUNCTIONS:
        spark.sql(f"DROP TEMPORARY FUNCTION {name}")
    assert not jvm_functions.registered(spark)
    yield spark
    assert jvm_functions.register(spark)


def _ngram_rows(spark, texts, n):
    from spark_jobs.decontam import _ngram_hashes
    from pyspark.sql import functions as F

    df = spark.createDataFrame(list(enumerate(texts)), "i int, t string")
    return sorted(tuple(r) for r in _ngram_hashes(df, "i", F.col("t"), n).collect())


def _signatures(spark, texts, ngram):
    from spark_jobs.dedup import minhash_coefficients, minhash_signatures
    from pyspark.sql import functions as F

    df = spark.createDataFrame([(str(i), i, t) for i, t in enumerate(texts)], "event_id string, created_at long, _norm string")
    sigs = minhash_signatures(df, ngram, minhash_coefficients(1234, 5)).select("event_id", F.col("_sigs"))
    return {r.event_id: list(r._sigs) for r in sigs.collect()}


def test_ngram_hashes_equal_spark_sql(spark):
    texts = _texts(300)
    fast = {n: _ngram_rows(spark, texts, n) for n in (1, 3, 13)}
    for name in jvm_functions.FUNCTIONS:
        spark.sql(f"DROP TEMPORARY FUNCTION {name}")
    try:
        slow = {n: _ngram_rows(spark, texts, n) for n in (1, 3, 13)}
    finally:
        assert jvm_functions.register(spark)
    for n in fast:
        assert fast[n] == slow[n], f"n={n}"
        assert len(fast[n]) > 100  # not two empty lists


def test_minhash_signatures_equal_spark_sql_and_python(spark, sql_only):
    import zlib

    from spark_jobs.dedup import MINHASH_PRIME, minhash_coefficients

    texts = _texts(300, seed=9)
    slow = {g: _signatures(spark, texts, g) for g in (1, 3)}
    assert jvm_functions.register(spark)
    fast = {g: _signatures(spark, texts, g) for g in (1, 3)}
    coeffs = minhash_coefficients(1234, 5)
    for g in (1, 3):
        assert fast[g] == slow[g]
        for i, text in enumerate(texts):  # and the bench baseline's formula (bench/finetune_reference.py)
            words = text.split(" ")
            shingles = {" ".join(words[j:j + g]) for j in range(len(words) - g + 1)} or {" ".join(words)}
            hashes = [zlib.crc32(s.encode()) for s in shingles]
            assert fast[g][str(i)] == [min((a * h + b) % MINHASH_PRIME for h in hashes) for a, b in coeffs]


def test_job_outputs_identical_without_the_functions(planted_run, sql_only, tmp_path):
    """The whole finetune job on the planted log through the Spark SQL path: same files, byte for byte."""
    from spark_jobs.finetune_dataset import run
    from transport.settings import KafkaSettings

    settings, fast = planted_run
    assert fast.card["drops"]["decontam"] and fast.card["drops"]["near_dedup"], "the planted log must exercise both"
    slow = run(sql_only, settings.model_copy(update={"out": tmp_path / "sql"}), KafkaSettings())
    for name in ("sft/train.jsonl", "sft/validation.jsonl", "preference/train.jsonl", "preference/validation.jsonl",
                 "dataset_card.json", "dataset_card.md"):
        assert filecmp.cmp(fast.out / name, slow.out / name, shallow=False), name


def test_text_chars_equal_spark_sql(spark):
    """Quality's text-character count: the one-pass Java count == the two regex replacements, on random
    text mixing letters of several scripts, digits, prose punctuation, symbols, emoji (two UTF-16 units),
    whitespace, URLs and whitespace-free runs around the 40-character limit."""
    from pyspark.sql import functions as F

    from spark_jobs.filters import text_char_count

    rng = random.Random(7)
    pieces = ["word", "Ünïcode", "日本語", "😀", "12.5%", "$4.2M", "(Q3:", "{x}", "<tag>", "a_b", "|", "\\", "^", "\ufffd",
              "https://example.com/a/b", "a:/b", "://", " ", "  ", "\t", "\n", "\r\n", "—", "€", "x" * 39, "y" * 40,
              "z" * 41, "QUJD" * 15, "=+~#@&*"]
    texts = ["", " ", "x" * 40, "x" * 39 + "😀", "😀" * 40, "http://" + "a" * 50, "a" * 50 + "://", "a" * 45 + ":/"]
    for _ in range(400):
        texts.append("".join(rng.choice(pieces) + rng.choice(["", " ", ""]) for _ in range(rng.randrange(1, 30))))
    df = spark.createDataFrame(list(enumerate(texts)), "i int, t string")
    fast = dict(df.select("i", text_char_count(F.col("t"), spark)).collect())
    for name in jvm_functions.FUNCTIONS:
        spark.sql(f"DROP TEMPORARY FUNCTION {name}")
    try:
        slow = dict(df.select("i", text_char_count(F.col("t"), spark)).collect())
    finally:
        assert jvm_functions.register(spark)
    assert fast == slow
    assert len(set(fast.values())) > 50  # varied counts, not a constant


def test_without_javac_the_job_is_told_to_use_spark_sql(tmp_path, monkeypatch, caplog):
    """Catches a JRE-only machine failing the job (or shipping a jar that was never built): no jar,
    one warning that names the cause, and the session conf without the functions jar."""
    from spark_jobs.jars import spark_version
    from spark_jobs.session import session_conf
    from spark_jobs.settings import SparkSettings

    monkeypatch.setattr(jvm_functions, "_javac", lambda: None)
    cache = tmp_path / "cache"  # no functions jar built yet; the connector jars from the machine's cache
    cache.mkdir()
    (cache / spark_version()).symlink_to(SparkSettings().jars_cache_dir / spark_version())
    with caplog.at_level("WARNING", logger="spark_jobs.jvm_functions"):
        assert jvm_functions.functions_jar(cache) is None
        conf = session_conf(SparkSettings(jars_cache_dir=cache, class_data_sharing=False))
    assert "javac not found" in caplog.text
    assert jvm_functions.JAR_PREFIX not in conf["spark.jars"] and "spark-avro" in conf["spark.jars"]
