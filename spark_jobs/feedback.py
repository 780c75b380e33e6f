"""Feedback joined to turns: which turns become SFT examples, which prompts give preference pairs.

A turn's rating is the kind of the *latest* feedback on its ``request_id`` (users change
their minds): THUMBS_UP -> ``up``; THUMBS_DOWN, REGENERATE, EDIT -> ``down`` (a regeneration
or an edit says the answer was not good enough). No feedback -> no rating.

- SFT examples: turns not rated down. The others are dropped at step ``feedback`` with reason
  ``rated_down`` (detail: the feedback kind).
- Preference pairs (conversational, for DPO): within one conversation, turns with the same
  normalised prompt (the original and its regenerations) where some answer is rated up and
  another rated down: every (up, down) combination is a pair, ``chosen`` = the up answer,
  ``rejected`` = the down one. An EDIT also gives a pair: chosen = the user's edited text
  (redacted), rejected = the original answer.

Both sides come from turns that passed redaction, quality filters and decontamination.
Not here: conversation history (``chat_format``), dedup of SFT examples (``dedup``).
"""

from __future__ import annotations

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from spark_jobs.pii import redact_column
from spark_jobs.steps import tag

DOWN_KINDS = ("THUMBS_DOWN", "REGENERATE", "EDIT")


def redact_feedback(feedback: DataFrame) -> DataFrame:
    return feedback.withColumn("edited_text", redact_column(F.col("edited_text"))).withColumn(
        "comment", redact_column(F.col("comment")))


def latest_ratings(feedback: DataFrame) -> DataFrame:
    """request_id -> rating (up|down), kind and edited_text of the latest feedback on it."""
    w = Window.partitionBy("request_id").orderBy(F.desc("created_at"), F.desc("event_id"))
    return (
        feedback.withColumn("_n", F.row_number().over(w)).where("_n = 1")
        .select("request_id", F.col("kind").alias("feedback_kind"),
                F.when(F.col("kind") == "THUMBS_UP", "up").otherwise("down").alias("rating"),
                F.col("edited_text").alias("feedback_edited_text"))
    )


def join_ratings(turns: DataFrame, ratings: DataFrame) -> DataFrame:
    return turns.join(ratings, "request_id", "left")


def drop_rated_down(rated: DataFrame) -> DataFrame:
    """Step ``feedback``: live turns rated down are no SFT examples (they may still be a pair's rejected side)."""
    return tag(rated, "feedback", F.when(F.col("rating") == "down", F.lit("rated_down")),
               F.concat(F.lit("kind="), F.col("feedback_kind")))


def preference_pairs(rated: DataFrame) -> DataFrame:
    """Columns: conversation_id, turn_index, system_prompt, prompt, chosen, rejected,
    chosen_event_id, rejected_event_id, created_at, pair_source (regenerate|edit)."""
    key = F.trim(F.regexp_replace(F.lower("prompt"), r"[^\p{L}\p{N}]+", " "))
    base = rated.where(F.col("rating").isNotNull()).withColumn("_pkey", key)
    up = base.where("rating = 'up'").select(
        "conversation_id", "_pkey", "turn_index", "system_prompt", "prompt", "created_at",
        F.col("answer").alias("chosen"), F.col("event_id").alias("chosen_event_id"))
    down = base.where("rating = 'down'").select(
        "conversation_id", "_pkey", F.col("answer").alias("rejected"),
        F.col("event_id").alias("rejected_event_id"))
    regenerated = up.join(down, ["conversation_id", "_pkey"]).withColumn("pair_source", F.lit("regenerate"))
    edits = base.where((F.col("feedback_kind") == "EDIT") & (F.length(F.trim("feedback_edited_text")) > 0)).select(
        "conversation_id", "_pkey", "turn_index", "system_prompt", "prompt", "created_at",
        F.col("feedback_edited_text").alias("chosen"),
        F.concat(F.col("event_id"), F.lit(":edit")).alias("chosen_event_id"),
        F.col("answer").alias("rejected"), F.col("event_id").alias("rejected_event_id"),
        F.lit("edit").alias("pair_source"))
    pairs = regenerated.unionByName(edits).where(F.col("chosen") != F.col("rejected"))
    return pairs.drop("_pkey").dropDuplicates(["chosen_event_id", "rejected_event_id"])
