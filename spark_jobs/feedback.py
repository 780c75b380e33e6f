"""Feedback joined to turns: which turns become SFT examples, which prompts give preference pairs.

A turn's rating is the kind of the *latest* feedback on its (``tenant``, ``request_id``) (users
change their minds): THUMBS_UP -> ``up``; THUMBS_DOWN, REGENERATE, EDIT -> ``down`` (a
regeneration or an edit says the answer was not good enough). No feedback -> no rating.

Feedback counts only when it comes from the turn's tenant, and from the turn's user where both
name one (:func:`check_owner`, step ``feedback_owner``): a request id is only unique within the
tenant that made it, and a tenant must not down-rate, or "edit" (choose the DPO answer of),
another tenant's or user's turn. Feedback whose request id belongs to turns of other tenants
only is dropped with reason ``other_tenant``; of the right tenant but another user,
``other_user``. Feedback matching no turn at all (its turn is outside the time range, or was
erased) is left alone: it rates nothing.

- SFT examples: turns not rated down. The others are dropped at step ``feedback`` with reason
  ``rated_down`` (detail: the feedback kind).
- Preference pairs (conversational, for DPO): within one conversation (``conversation_key``:
  tenant, user and conversation id), turns with the same
  normalised prompt (the original and its regenerations) where some answer is rated up and
  another rated down: every (up, down) combination is a pair, ``chosen`` = the up answer,
  ``rejected`` = the down one. An EDIT also gives a pair: chosen = the user's edited text
  (redacted), rejected = the original answer.

Both sides come from turns that passed redaction, quality filters and decontamination.
Not here: conversation history (``chat_format``), dedup of SFT examples (``dedup``).
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from spark_jobs.pii import redact_column
from spark_jobs.steps import tag


def redact_feedback(feedback: DataFrame) -> DataFrame:
    return feedback.withColumn("edited_text", redact_column(F.col("edited_text"))).withColumn(
        "comment", redact_column(F.col("comment")))


def _unknown(user: Column) -> Column:
    return user.isNull() | (F.length(F.trim(user)) == 0)


def check_owner(feedback: DataFrame, turns: DataFrame) -> DataFrame:
    """Step ``feedback_owner`` on tagged ``feedback``: live feedback rating turns of another
    tenant (``other_tenant``) or another user of its tenant (``other_user``) is dropped.

    ``turns``: the decoded live turns (tenant, user_id, request_id). One row per request id on
    the look-up side, so the join keeps one row per feedback.
    """
    owners = turns.where(F.col("request_id").isNotNull()).groupBy("request_id").agg(
        F.collect_set(F.struct(F.col("tenant").alias("t"), F.col("user_id").alias("u"))).alias("_owners"))
    f = feedback.join(owners, "request_id", "left")
    same_tenant = F.exists("_owners", lambda o: o["t"] == F.col("tenant"))
    same_user = F.exists("_owners", lambda o: (o["t"] == F.col("tenant")) & (
        (o["u"] == F.col("user_id")) | _unknown(o["u"]) | _unknown(F.col("user_id"))))
    reason = (F.when(F.col("_owners").isNull() | same_user, F.lit(None).cast("string"))
              .when(same_tenant, F.lit("other_user")).otherwise(F.lit("other_tenant")))
    return tag(f, "feedback_owner", reason, F.concat(F.lit("request_id="), F.col("request_id"))).select(
        *feedback.columns)


def latest_ratings(feedback: DataFrame) -> DataFrame:
    """(tenant, request_id) -> rating (up|down), kind and edited_text of the latest feedback on it
    (live feedback: :func:`check_owner` dropped what came from another tenant or user)."""
    w = Window.partitionBy("tenant", "request_id").orderBy(F.desc("created_at"), F.desc("event_id"))
    return (
        feedback.withColumn("_n", F.row_number().over(w)).where("_n = 1")
        .select("tenant", "request_id", F.col("kind").alias("feedback_kind"),
                F.when(F.col("kind") == "THUMBS_UP", "up").otherwise("down").alias("rating"),
                F.col("edited_text").alias("feedback_edited_text"))
    )


def join_ratings(turns: DataFrame, ratings: DataFrame) -> DataFrame:
    return turns.join(ratings, ["tenant", "request_id"], "left")


def drop_rated_down(rated: DataFrame) -> DataFrame:
    """Step ``feedback``: live turns rated down are no SFT examples (they may still be a pair's rejected side)."""
    return tag(rated, "feedback", F.when(F.col("rating") == "down", F.lit("rated_down")),
               F.concat(F.lit("kind="), F.col("feedback_kind")))


def preference_pairs(rated: DataFrame) -> DataFrame:
    """Columns: tenant, subject, conversation_key, conversation_id, turn_index, system_prompt,
    prompt, chosen, rejected, chosen_event_id, rejected_event_id, chosen_request_id,
    rejected_request_id, chosen_trace_id, rejected_trace_id (lineage: the turns of each side; an
    edit's two sides are one turn), created_at (of the chosen side's turn), rejected_created_at,
    pair_source (regenerate|edit).

    Both sides of a pair come from one ``conversation_key`` (tenant, user, conversation id), so a
    pair never joins two tenants' or two users' turns that share a client-chosen conversation id.
    """
    key = F.trim(F.regexp_replace(F.lower("prompt"), r"[^\p{L}\p{N}]+", " "))
    base = rated.where(F.col("rating").isNotNull()).withColumn("_pkey", key)
    ids = ("tenant", "subject", "conversation_key", "conversation_id")
    up = base.where("rating = 'up'").select(
        *ids, "_pkey", "turn_index", "system_prompt", "prompt", "created_at",
        F.col("answer").alias("chosen"), F.col("event_id").alias("chosen_event_id"),
        F.col("request_id").alias("chosen_request_id"), F.col("trace_id").alias("chosen_trace_id"))
    down = base.where("rating = 'down'").select(
        "conversation_key", "_pkey", F.col("answer").alias("rejected"),
        F.col("event_id").alias("rejected_event_id"), F.col("created_at").alias("rejected_created_at"),
        F.col("request_id").alias("rejected_request_id"), F.col("trace_id").alias("rejected_trace_id"))
    regenerated = up.join(down, ["conversation_key", "_pkey"]).withColumn("pair_source", F.lit("regenerate"))
    edits = base.where((F.col("feedback_kind") == "EDIT") & (F.length(F.trim("feedback_edited_text")) > 0)).select(
        *ids, "_pkey", "turn_index", "system_prompt", "prompt", "created_at",
        F.col("feedback_edited_text").alias("chosen"),
        F.concat(F.col("event_id"), F.lit(":edit")).alias("chosen_event_id"),
        F.col("request_id").alias("chosen_request_id"), F.col("trace_id").alias("chosen_trace_id"),
        F.col("answer").alias("rejected"), F.col("event_id").alias("rejected_event_id"),
        F.col("created_at").alias("rejected_created_at"),
        F.col("request_id").alias("rejected_request_id"), F.col("trace_id").alias("rejected_trace_id"),
        F.lit("edit").alias("pair_source"))
    pairs = regenerated.unionByName(edits).where(F.col("chosen") != F.col("rejected"))
    return pairs.drop("_pkey").dropDuplicates(["chosen_event_id", "rejected_event_id"])
