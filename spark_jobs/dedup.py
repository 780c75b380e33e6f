"""Exact and near-duplicate removal over SFT candidates (step ``exact_dedup``, ``near_dedup``).

Both compare the *normalised* text of prompt + answer: lower case, every run of characters
that are not letters or digits replaced by one space, trimmed. Of a group of duplicates the
earliest turn (``created_at``, then ``event_id``) is kept, so the choice is the same on every
run and every source.

- ``exact_dedup``: equal normalised text; reason ``exact_duplicate``, detail
  ``duplicate_of=<event_id kept>``. A window over the text, no Python.
- ``near_dedup``: Jaccard similarity of word ``near_dup_ngram``-shingle sets at or above
  ``near_dup_threshold``, found with pyspark.ml ``MinHashLSH`` (``approxSimilarityJoin``
  computes the exact Jaccard distance of every candidate pair, so no pair under the threshold
  is dropped; recall grows with ``near_dup_hash_tables``). Reason ``near_duplicate``, detail
  ``near_duplicate_of=<event_id> jaccard=<sim>``. A turn is dropped when an earlier kept-or-not
  turn is similar to it; in a chain A~B~C with A !~ C both B and C go (no connected
  components: cheaper, and a chain of near-duplicates is one cluster anyway).

Not here: deciding which turns are SFT candidates (``feedback``).
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from spark_jobs.steps import is_live, tag

NUM_FEATURES = 1 << 20  # HashingTF buckets for shingles; collisions only raise similarity slightly


def normalized_text() -> Column:
    """Normalised prompt + answer (the dedup key)."""
    text = F.concat_ws(" ", F.col("prompt"), F.col("answer"))
    return F.trim(F.regexp_replace(F.lower(text), r"[^\p{L}\p{N}]+", " "))


def exact_dedup(df: DataFrame) -> DataFrame:
    """``df`` (tagged) with live duplicates of an earlier live turn dropped.

    The window is also partitioned on liveness, so rows dropped earlier neither count as
    originals nor get ranked.
    """
    order = Window.partitionBy(is_live(), "_norm").orderBy("created_at", "event_id", "source_partition",
                                                           "source_offset")
    tagged = (
        df.withColumn("_norm", normalized_text())
        .withColumn("_rank", F.row_number().over(order))
        .withColumn("_first", F.first("event_id").over(order))
    )
    tagged = tag(tagged, "exact_dedup", F.when(F.col("_rank") > 1, F.lit("exact_duplicate")),
                 F.concat(F.lit("duplicate_of="), F.col("_first")))
    return tagged.drop("_norm", "_rank", "_first")


def _shingles(ngram: int) -> Column:
    words = F.split(normalized_text(), " ")
    grams = F.transform(
        F.sequence(F.lit(0), F.size(words) - ngram),
        lambda i: F.array_join(F.slice(words, i + 1, ngram), " "),
    )
    # Texts shorter than one shingle become one shingle (MinHash needs a non-empty set).
    return F.when(F.size(words) < ngram, F.array(F.array_join(words, " "))).otherwise(grams)


def near_dedup(df: DataFrame, threshold: float, ngram: int, hash_tables: int, seed: int) -> DataFrame:
    """``df`` (tagged; cache it: it is read twice) with live near-duplicates of an earlier live turn dropped."""
    from pyspark.ml.feature import HashingTF, MinHashLSH

    docs = df.where(is_live()).select("event_id", "created_at", _shingles(ngram).alias("_shingles"))
    docs = HashingTF(inputCol="_shingles", outputCol="_features", numFeatures=NUM_FEATURES,
                     binary=True).transform(docs)
    model = MinHashLSH(inputCol="_features", outputCol="_hashes", numHashTables=hash_tables,
                       seed=seed).fit(docs)
    hashed = model.transform(docs).cache()  # both sides of the self-join
    max_distance = 1.0 - threshold + 1e-9  # the join keeps distance < max_distance
    pairs = model.approxSimilarityJoin(hashed, hashed, max_distance, distCol="_dist").select(
        F.col("datasetA.event_id").alias("keep_id"), F.col("datasetA.created_at").alias("keep_at"),
        F.col("datasetB.event_id").alias("event_id"), F.col("datasetB.created_at").alias("at"),
        "_dist",
    )
    earlier = F.struct("keep_at", "keep_id") < F.struct("at", "event_id")
    # Per later turn, the earliest similar turn (deterministic detail).
    dups = (
        pairs.where(earlier)
        .groupBy("event_id")
        .agg(F.min(F.struct("keep_at", "keep_id", "_dist")).alias("_m"))
        .select("event_id", F.col("_m.keep_id").alias("_near_of"), F.col("_m._dist").alias("_dist"))
    )
    tagged = tag(df.join(dups, "event_id", "left"), "near_dedup",
                 F.when(F.col("_near_of").isNotNull(), F.lit("near_duplicate")),
                 F.format_string("near_duplicate_of=%s jaccard=%.3f", F.col("_near_of"), 1 - F.col("_dist")))
    return tagged.drop("_near_of", "_dist")
