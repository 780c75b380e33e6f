"""Exact and near-duplicate removal over SFT candidates (step ``exact_dedup``, ``near_dedup``).

Both compare the *normalised* text of prompt + answer: lower case, every run of characters
that are not letters or digits replaced by one space, trimmed. Of a group of duplicates the
earliest turn (``created_at``, then ``event_id``) is kept, so the choice is the same on every
run and every source.

- ``exact_dedup``: equal normalised text; reason ``exact_duplicate``, detail
  ``duplicate_of=<event_id kept>``. A window over the text, no Python.
- ``near_dedup``: Jaccard similarity of word ``near_dup_ngram``-shingle sets at or above
  ``near_dup_threshold``, found with MinHash LSH written in Spark SQL (see :func:`near_dedup`;
  the exact Jaccard of every candidate pair is computed, so no pair under the threshold is
  dropped; recall grows with ``near_dup_hash_tables``). The hash functions are those of the
  single-process baseline (``bench/finetune_reference.py``), so given the same normalised
  text both drop exactly the same turns. Reason ``near_duplicate``, detail
  ``near_duplicate_of=<event_id> jaccard=<sim>``. A turn is dropped when an earlier kept-or-not
  turn is similar to it; in a chain A~B~C with A !~ C both B and C go (no connected
  components: cheaper, and a chain of near-duplicates is one cluster anyway).

Not here: deciding which turns are SFT candidates (``feedback``).
"""

from __future__ import annotations

import random

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from spark_jobs import jvm_functions
from spark_jobs.steps import is_live, materialize, tag


def normalize(text: Column) -> Column:
    """Lower case, every run of characters other than letters and digits -> one space, trimmed."""
    return F.trim(F.regexp_replace(F.lower(text), r"[^\p{L}\p{N}]+", " "))


def normalized_text() -> Column:
    """Normalised prompt + answer (the dedup key)."""
    return normalize(F.concat_ws(" ", F.col("prompt"), F.col("answer")))


def norm_column(df: DataFrame) -> Column:
    """The dedup key of ``df``'s rows: its stored ``_norm`` column when it has one (the job
    computes it once, after redaction: the regex over every text was a large share of the CPU
    time when decontamination, exact and near dedup each computed it), else computed here."""
    return F.col("_norm") if "_norm" in df.columns else normalized_text()


def exact_dedup(df: DataFrame) -> DataFrame:
    """``df`` (tagged) with live duplicates of an earlier live turn dropped.

    The window is also partitioned on liveness, so rows dropped earlier neither count as
    originals nor get ranked.
    """
    # One window (same partitioning, order and frame for both functions) over a stored liveness
    # column: an expression as a partition key is recomputed per window and each got its own
    # shuffle of every row (seen in the plan: two Exchanges of the whole frame).
    order = Window.partitionBy("_live", "_norm").orderBy(
        "created_at", "event_id", "source_partition", "source_offset").rowsBetween(
        Window.unboundedPreceding, Window.currentRow)
    tagged = (
        df.select(*[c for c in df.columns if c != "_norm"], is_live().alias("_live"), norm_column(df).alias("_norm"))
        .select("*", F.row_number().over(order).alias("_rank"), F.first("event_id").over(order).alias("_first"))
    )
    tagged = tag(tagged, "exact_dedup", F.when(F.col("_rank") > 1, F.lit("exact_duplicate")),
                 F.concat(F.lit("duplicate_of="), F.col("_first")))
    tagged = tagged.drop("_live", "_rank", "_first")
    return tagged if "_norm" in df.columns else tagged.drop("_norm")


#: Modulus of the MinHash hash functions ``h -> (a*h + b) mod P`` (a Mersenne prime; with
#: ``a, b < P`` and 32-bit ``h`` the product stays under 2**63, so Spark's long arithmetic is exact).
MINHASH_PRIME = (1 << 31) - 1


def minhash_coefficients(seed: int, tables: int) -> list[tuple[int, int]]:
    """The (a, b) of each table's hash function, drawn from ``seed`` (the baseline draws the same)."""
    rng = random.Random(seed)
    return [(rng.randrange(1, MINHASH_PRIME), rng.randrange(0, MINHASH_PRIME)) for _ in range(tables)]


def word_ngrams(df: DataFrame, words: str, n: int, out: str) -> DataFrame:
    """``df`` plus ``out``: the word ``n``-grams of the array column ``words``, joined by one space
    (texts shorter than ``n`` words get none).

    pyspark.ml's ``NGram`` (a Scala function, compiled into the generated code) rather than a
    ``transform(sequence(...), i -> array_join(slice(...)))``: Spark evaluates a higher-order
    function's lambda interpreted, element by element, which made n-grams the job's slowest
    part (the same strings: ``NGram`` joins with one space too).
    """
    from pyspark.ml.feature import NGram

    return NGram(n=n, inputCol=words, outputCol=out).transform(df)


def _shingle_sets(docs: DataFrame, ngram: int) -> DataFrame:
    """``docs`` (with prompt, answer) plus ``_shingles``: the distinct word ``ngram``-shingles of
    the normalised text; a text shorter than one shingle is one shingle (MinHash needs a
    non-empty set)."""
    words = docs.select("*", F.split(norm_column(docs), " ").alias("_words"))
    return word_ngrams(words, "_words", ngram, "_grams").select(
        *docs.columns, F.array_distinct(F.when(F.size("_words") < ngram, F.array(F.array_join("_words", " ")))
                                        .otherwise(F.col("_grams"))).alias("_shingles"))


def minhash_signatures(docs: DataFrame, ngram: int, coeffs: list[tuple[int, int]]) -> DataFrame:
    """(event_id, created_at, _sigs): per table ``k`` the minimum over the distinct shingles' CRC-32
    values ``h`` of ``(a_k*h + b_k) mod P``."""
    if jvm_functions.registered(docs.sparkSession):  # the same values, one call per document
        spec = ",".join(f"{a}:{b}" for a, b in coeffs)
        sig = F.call_function(jvm_functions.MINHASH_SIGNATURE, norm_column(docs).cast("binary"), F.lit(ngram),
                              F.lit(spec))
        return docs.select("event_id", "created_at", sig.alias("_sigs"))
    h = F.crc32(F.col("_shingle").cast("binary"))
    return (_shingle_sets(docs, ngram).select("event_id", "created_at", F.explode("_shingles").alias("_shingle"))
            .groupBy("event_id", "created_at")
            .agg(F.array(*[F.min((h * a + b) % MINHASH_PRIME) for a, b in coeffs]).alias("_sigs")))


def near_dedup(df: DataFrame, threshold: float, ngram: int, hash_tables: int, seed: int) -> DataFrame:
    """``df`` (tagged; materialise it, ``steps.materialize``: it is read more than once) with live
    near-duplicates of an earlier live turn dropped.

    MinHash LSH in Spark SQL: per document, the distinct shingles' CRC-32 values ``h`` and, per
    table ``k``, the signature ``min((a_k*h + b_k) mod P)`` (:func:`minhash_signatures`);
    one row per (table, signature); a join on (table, signature) restricted to earlier -> later
    pairs gives the candidates; the exact Jaccard of their shingle sets decides. Why not
    pyspark.ml's ``approxSimilarityJoin``: it joined and ``distinct``-ed whole rows with their
    feature vectors, both directions of every pair and every document with itself in each
    table (the job's slowest step by far).
    """
    coeffs = minhash_coefficients(seed, hash_tables)
    live_docs = df.where(is_live()).select("event_id", "created_at", *(
        ["_norm"] if "_norm" in df.columns else ["prompt", "answer"]))
    sigs = minhash_signatures(live_docs, ngram, coeffs).select(
        "event_id", "created_at", F.posexplode("_sigs").alias("_table", "_sig"))
    # Shuffle join on (table, signature): both sides are the same exchange (Spark reuses it).
    a, b = sigs.alias("a"), sigs.hint("shuffle_hash").alias("b")
    pairs = materialize(  # small, and read three times below
        a.join(b, (F.col("a._table") == F.col("b._table")) & (F.col("a._sig") == F.col("b._sig"))
               & (F.struct("a.created_at", "a.event_id") < F.struct("b.created_at", "b.event_id")))
        .select(F.col("a.event_id").alias("keep_id"), F.col("a.created_at").alias("keep_at"),
                F.col("b.event_id").alias("event_id"))
        .distinct())  # a pair that collides in several tables
    # Shingles again only for the documents in a candidate pair (few), not for every document:
    # a broadcast semi-join picks them first. Broadcasts are explicit: the planner, misled by the
    # small estimated width of an array column, would broadcast every document's shingles.
    ids = pairs.select(F.col("keep_id").alias("event_id")).union(pairs.select("event_id")).distinct()
    sh = _shingle_sets(live_docs.join(F.broadcast(ids), "event_id", "left_semi"), ngram).select(
        "event_id", "_shingles")
    kept_side = sh.select(F.col("event_id").alias("keep_id"), F.col("_shingles").alias("_ks"))
    scored = (pairs.join(F.broadcast(kept_side), "keep_id").join(F.broadcast(sh), "event_id")
              .select("event_id", "keep_id", "keep_at", (
                  F.size(F.array_intersect("_ks", "_shingles")) / F.size(F.array_union("_ks", "_shingles"))
              ).alias("_sim")))
    # Per later turn, the earliest similar turn (deterministic detail).
    dups = (
        scored.where(F.col("_sim") >= threshold)
        .groupBy("event_id")
        .agg(F.min(F.struct("keep_at", "keep_id", "_sim")).alias("_m"))
        .select("event_id", F.col("_m.keep_id").alias("_near_of"), F.col("_m._sim").alias("_sim"))
    )
    tagged = tag(df.join(F.broadcast(dups), "event_id", "left"), "near_dedup",
                 F.when(F.col("_near_of").isNotNull(), F.lit("near_duplicate")),
                 F.format_string("near_duplicate_of=%s jaccard=%.3f", F.col("_near_of"), F.col("_sim")))
    return tagged.drop("_near_of", "_sim")
