"""Conversation history and OpenAI chat messages for SFT examples and preference pairs.

An example's messages are: its system prompt (or ``default_system_prompt``, or none), then
earlier turns of its conversation (``conversation_key``: same tenant, user and conversation id)
as user/assistant pairs, newest kept first while the whole
example fits ``max_context_tokens``, then its own prompt and answer. Earlier turns come from
the *history pool*: turns that passed redaction, quality and decontamination and were not
rated down, one per turn index (the latest, so a regeneration replaces what it regenerated).
Dropped turns never reach an output as history.

History stops at a gap: only the unbroken run of turn indexes just before the example's own
(n-1, n-2, ...) is used, up to the first index missing from the pool (dropped, rated down, or
outside the time range). Why not skip the hole: the later turns were answered in a conversation
that contained the missing one, so a history without it would teach answers to questions that
refer to something the example never shows (and the missing turn may be the very thing that
was dropped for PII or quality reasons).

Tokens are estimated as ceil(chars / 4) + 4 per message (no tokenizer dependency; about
right for English BPE vocabularies). The current turn is always kept, even when alone over
the budget (``too_long`` bounds it).
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

MESSAGE_OVERHEAD = 4
_HISTORY_TYPE = "array<struct<h_index:int,h_prompt:string,h_answer:string,h_request_id:string,h_trace_id:string>>"


def est_tokens(col: Column) -> Column:
    return F.when(col.isNull(), F.lit(0)).otherwise(F.ceil(F.length(col) / 4) + MESSAGE_OVERHEAD)


#: The conversation a history comes from: tenant, user and conversation id hashed together
#: (``erasure.conversation_key``). Not ``conversation_id`` alone: it is chosen by the client
#: (``chat-1``), and two tenants' or two users' turns under one id are two conversations.
CONVERSATION = "conversation_key"


def history_pool(turns: DataFrame) -> DataFrame:
    w = Window.partitionBy(CONVERSATION, "turn_index").orderBy(F.desc("created_at"), F.desc("event_id"))
    return (
        turns.where(F.col("rating").isNull() | (F.col("rating") != "down"))
        .withColumn("_n", F.row_number().over(w)).where("_n = 1")
        .select(CONVERSATION, F.col("turn_index").alias("h_index"), F.col("prompt").alias("h_prompt"),
                F.col("answer").alias("h_answer"), F.col("created_at").alias("h_created_at"),
                (est_tokens(F.col("prompt")) + est_tokens(F.col("answer"))).alias("h_tokens"),
                F.col("request_id").alias("h_request_id"), F.col("trace_id").alias("h_trace_id"))
    )


def with_history(examples: DataFrame, pool: DataFrame, id_col: str, own_tokens: Column,
                 budget: int) -> DataFrame:
    """``examples`` plus ``history``: array<struct<h_index, h_prompt, h_answer, h_request_id,
    h_trace_id>> in turn order (the ids: lineage, :func:`lineage_ids`),
    ``history_tokens``: the estimated tokens of those turns (0 without history), and
    ``history_oldest_at``: the earliest ``created_at`` among them (null without history).

    The history is the unbroken run of turns just before the example (module doc: it stops at
    the first missing turn index), newest first while it fits ``budget``.
    """
    ex = examples.withColumn("_own", own_tokens)
    # Which earlier turns fit is decided on narrow rows (ids, indexes, token counts); only the turns
    # that fit are joined with their text. Joining the texts first shuffled every (example, earlier
    # turn) pair with both texts, the format step's largest cost.
    cands = ex.select(id_col, CONVERSATION, "turn_index", "_own").join(
        pool.select(CONVERSATION, "h_index", "h_tokens", "h_created_at"), CONVERSATION).where(
        F.col("h_index") < F.col("turn_index"))
    newest = Window.partitionBy(id_col).orderBy(F.desc("h_index"))
    newest_first = newest.rowsBetween(Window.unboundedPreceding, Window.currentRow)
    # The pool has one turn per index, so the k-th newest candidate is turn n-k exactly while no
    # index is missing; both conditions keep a prefix of the newest-first order.
    fitting = (
        cands.withColumn("_cum", F.sum("h_tokens").over(newest_first))
        .withColumn("_back", F.row_number().over(newest))
        .where((F.col("turn_index") - F.col("h_index") == F.col("_back")) & (F.col("_cum") + F.col("_own") <= budget))
        .select(id_col, CONVERSATION, "h_index", "h_tokens", "h_created_at")
        .join(pool.select(CONVERSATION, "h_index", "h_prompt", "h_answer", "h_request_id", "h_trace_id"),
              [CONVERSATION, "h_index"])
        .groupBy(id_col)
        .agg(F.sort_array(F.collect_list(F.struct("h_index", "h_prompt", "h_answer", "h_request_id", "h_trace_id")))
             .alias("history"),
             F.sum("h_tokens").alias("history_tokens"), F.min("h_created_at").alias("history_oldest_at"))
    )
    return ex.join(fitting, id_col, "left").withColumn(
        "history", F.coalesce(F.col("history"), F.array().cast(_HISTORY_TYPE))
    ).withColumn("history_tokens", F.coalesce(F.col("history_tokens"), F.lit(0).cast("long"))).drop("_own")


def lineage_ids(history_field: str, own: Column) -> Column:
    """The ids (``history_field``: ``h_request_id`` or ``h_trace_id``) of the turns an example is
    built from, in turn order: its history's, then ``own`` (an array: the example's own turn; a
    pair's chosen then rejected turn). Null entries (a turn written before ConversationTurn v3 has
    no trace id) keep their place, so ``request_ids[i]`` and ``trace_ids[i]`` name the same turn."""
    return F.concat(F.transform(F.col("history"), lambda h: h[history_field]), own)


def _msg(role: str, content: Column) -> Column:
    return F.struct(F.lit(role).alias("role"), content.alias("content"))


def prompt_messages(default_system_prompt: str | None) -> Column:
    """system? + history + user prompt, as array<struct<role, content>>."""
    system = F.coalesce(F.col("system_prompt"), F.lit(default_system_prompt))
    sys_part = F.when(system.isNotNull(), F.array(_msg("system", system))).otherwise(
        F.array().cast("array<struct<role:string,content:string>>"))
    hist = F.flatten(F.transform(F.col("history"), lambda h: F.array(
        _msg("user", h["h_prompt"]), _msg("assistant", h["h_answer"]))))
    return F.concat(sys_part, hist, F.array(_msg("user", F.col("prompt"))))


def sft_messages(default_system_prompt: str | None) -> Column:
    return F.concat(prompt_messages(default_system_prompt), F.array(_msg("assistant", F.col("answer"))))
