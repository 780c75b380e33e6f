"""The dataset card's counts from one aggregate over the tagged records (see ``steps.tag``).

Why one aggregate: the job used to count kept and dropped rows after every step, one Spark
job each (about 20 of them, each recomputing or re-reading its input). Every record now carries
the step and reason that dropped it, so one ``groupBy(record, step, reason, writer version)``
with the PII placeholder sums gives all of it: records read per topic, schema versions, each
step's input/kept/dropped (a step's input is what the steps before it kept), drops per reason
and redactions per kind.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from spark_jobs.pii import KINDS, placeholder_count

#: Steps applied to turns after decoding, in pipeline order.
TURN_STEPS = ("quality", "decontam", "feedback", "exact_dedup", "near_dedup")
#: Steps applied to feedback after decoding.
FEEDBACK_STEPS = ("feedback_owner",)
_TEXT = ("system_prompt", "prompt", "answer")


def tally(turns: DataFrame, feedback: DataFrame) -> list[dict]:
    """Rows of counts (one action) over tagged ``turns`` and tagged ``feedback``."""
    pii = [sum((placeholder_count(F.col(c), k) for c in _TEXT), F.lit(0)).alias(k) for k in KINDS]
    t = turns.select(F.lit("ConversationTurn").alias("record"), "_step", "_reason", "writer_version", *pii)
    f = feedback.select(F.lit("Feedback").alias("record"), "_step", "_reason", "writer_version",
                        *[F.lit(0).alias(k) for k in KINDS])
    rows = (t.unionByName(f).groupBy("record", "_step", "_reason", "writer_version")
            .agg(F.count(F.lit(1)).alias("n"), *[F.sum(k).alias(k) for k in KINDS]).collect())
    return [r.asDict() for r in rows]


def fill_card(card, rows: list[dict], source: str, since: int | None, until: int | None,
              erased: dict[str, int] | None = None) -> None:
    """Set the card's input, steps, drops and pii from :func:`tally` rows.

    ``erased``: records left out for erasure per record type (before the tally: they are in no
    output, so the tagged frames do not hold them); they count as read and decoded, and a step
    ``erasure`` per record type says how many went.
    """
    erased = erased or {}
    def n(record: str, step=..., decoded: bool | None = None) -> int:
        return sum(r["n"] for r in rows if r["record"] == record
                   and (step is ... or r["_step"] == step)
                   and (decoded is None or (r["_step"] != "decode") == decoded))

    def add(step: str, input_: int, dropped: int) -> None:
        card.steps.append({"step": step, "input": input_, "kept": input_ - dropped, "dropped": dropped})

    def chain(record: str, steps: tuple[str, ...]) -> None:
        """One row per step, each taking what the steps before it kept (erased records are not in ``rows``)."""
        live = n(record, decoded=True)
        for step in steps:
            add(step, live, n(record, step))
            live -= n(record, step)

    read = {rec: n(rec) + erased.get(rec, 0) for rec in ("ConversationTurn", "Feedback")}
    for rec, label in (("ConversationTurn", "decode turns"), ("Feedback", "decode feedback")):
        add(label, read[rec], read[rec] - n(rec, decoded=True) - erased.get(rec, 0))
    for rec, label in (("ConversationTurn", "erasure turns"), ("Feedback", "erasure feedback")):
        add(label, n(rec, decoded=True) + erased.get(rec, 0), erased.get(rec, 0))
    chain("Feedback", FEEDBACK_STEPS)
    versions: dict[int, int] = {}
    for r in rows:
        if r["record"] == "ConversationTurn" and r["_step"] != "decode":
            versions[r["writer_version"]] = versions.get(r["writer_version"], 0) + r["n"]
    card.input = {"source": source, "since_ms": since, "until_ms": until,
                  "turns_read": read["ConversationTurn"], "feedback_read": read["Feedback"],
                  **{f"ConversationTurn v{v}": versions[v] for v in sorted(versions)}}
    chain("ConversationTurn", TURN_STEPS)
    drops: dict[tuple[str, str], int] = {}
    for r in rows:
        if r["_step"] is not None:
            drops[(r["_step"], r["_reason"])] = drops.get((r["_step"], r["_reason"]), 0) + r["n"]
    for (step, reason), count in sorted(drops.items()):
        card.drops.setdefault(step, {})[reason] = count
    card.pii = {k: int(sum(r[k] or 0 for r in rows if r["record"] == "ConversationTurn")) for k in KINDS}
