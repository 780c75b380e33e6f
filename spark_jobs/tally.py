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

    read = {rec: n(rec) + erased.get(rec, 0) for rec in ("ConversationTurn", "Feedback")}
    for rec, label in (("ConversationTurn", "decode turns"), ("Feedback", "decode feedback")):
        kept = n(rec, decoded=True) + erased.get(rec, 0)
        card.steps.append({"step": label, "input": read[rec], "kept": kept, "dropped": read[rec] - kept})
    for rec, label in (("ConversationTurn", "erasure turns"), ("Feedback", "erasure feedback")):
        decoded = n(rec, decoded=True) + erased.get(rec, 0)
        card.steps.append({"step": label, "input": decoded, "kept": decoded - erased.get(rec, 0),
                           "dropped": erased.get(rec, 0)})
    f_in = n("Feedback", decoded=True)
    for step in FEEDBACK_STEPS:
        dropped = n("Feedback", step)
        card.steps.append({"step": step, "input": f_in, "kept": f_in - dropped, "dropped": dropped})
        f_in -= dropped
    versions: dict[int, int] = {}
    for r in rows:
        if r["record"] == "ConversationTurn" and r["_step"] != "decode":
            versions[r["writer_version"]] = versions.get(r["writer_version"], 0) + r["n"]
    card.input = {"source": source, "since_ms": since, "until_ms": until,
                  "turns_read": read["ConversationTurn"], "feedback_read": read["Feedback"],
                  **{f"ConversationTurn v{v}": versions[v] for v in sorted(versions)}}
    n_in = n("ConversationTurn", decoded=True)  # erased turns are not in ``rows``
    for step in TURN_STEPS:
        dropped = n("ConversationTurn", step)
        card.steps.append({"step": step, "input": n_in, "kept": n_in - dropped, "dropped": dropped})
        n_in -= dropped
    drops: dict[tuple[str, str], int] = {}
    for r in rows:
        if r["_step"] is not None:
            drops[(r["_step"], r["_reason"])] = drops.get((r["_step"], r["_reason"]), 0) + r["n"]
    for (step, reason), count in sorted(drops.items()):
        card.drops.setdefault(step, {})[reason] = count
    card.pii = {k: int(sum(r[k] or 0 for r in rows if r["record"] == "ConversationTurn")) for k in KINDS}
