"""History stops at a dropped middle turn, in the Spark job's formatting and in the bench's
Python baseline alike (bench/finetune.py compares the two, so they must share the rule)."""

from __future__ import annotations

import json
import random

import pytest

from chatpipe.testing.synthetic_log import START_MS, SyntheticLog, _turn, _Words, to_messages
from spark_jobs.settings import FinetuneSettings

pytestmark = pytest.mark.spark

#: (conversation, turn index) -> the turn indexes its history must hold. Turn 1 of "conv-gap" is
#: dropped (empty answer): turns 2.. keep only what follows it.
EXPECTED = {("conv-gap", 0): [], ("conv-gap", 2): [], ("conv-gap", 3): [2], ("conv-gap", 4): [2, 3],
            ("conv-whole", 0): [], ("conv-whole", 1): [0], ("conv-whole", 2): [0, 1]}


def _log() -> SyntheticLog:
    rng = random.Random(5)
    words = _Words(rng)
    log = SyntheticLog()
    for conv, n in (("conv-gap", 5), ("conv-whole", 3)):
        for i in range(n):
            answer = "   " if (conv, i) == ("conv-gap", 1) else words.answer()
            log.turns.append(_turn(rng, conv, i, words.text(8) + "?", answer, START_MS + i * 60_000))
    return log


def _spark_histories(spark, log: SyntheticLog) -> dict:
    """(conversation, index) -> history indexes, from chat_format over the turns that passed."""
    from pyspark.sql import functions as F

    from spark_jobs.chat_format import est_tokens, history_pool, with_history

    passed = [t for t in log.turns if t.answer.strip()]
    rows = [(t.event_id, t.conversation_id, t.turn_index, t.created_at, None, t.prompt, t.answer, t.request_id,
             t.trace_id) for t in passed]
    turns = spark.createDataFrame(rows, "event_id string, conversation_id string, turn_index int, created_at long, "
                                        "rating string, prompt string, answer string, request_id string, trace_id string")
    turns = turns.withColumn("conversation_key", F.col("conversation_id"))  # one tenant and user per conversation
    own = est_tokens(F.col("prompt")) + est_tokens(F.col("answer"))
    out = with_history(turns, history_pool(turns), "event_id", own, 2048).collect()
    return {(r.conversation_id, r.turn_index): [h.h_index for h in r.history] for r in out}


def _python_histories(log: SyntheticLog, tmp_path) -> dict:
    """(conversation, index) -> history indexes, from the JSONL of bench/finetune_reference.py."""
    import bench.finetune_reference as reference

    s = FinetuneSettings(source="archive", archive_dir=tmp_path, out=tmp_path / "unused", validation_fraction=0.0)
    reference.run(to_messages(log, "chat.turns", "chat.feedback"), s, tmp_path / "python")
    key_of = {t.prompt: (t.conversation_id, t.turn_index) for t in log.turns}
    got = {}
    for line in (tmp_path / "python" / "train.jsonl").read_text(encoding="utf-8").splitlines():
        users = [m["content"] for m in json.loads(line)["messages"] if m["role"] == "user"]
        got[key_of[users[-1]]] = [key_of[p][1] for p in users[:-1]]
    return got


def test_history_stops_at_a_dropped_middle_turn(spark, tmp_path):
    """Catches an example whose history skips over a dropped turn (a conversation with a hole: later
    answers refer to a question the example never shows), and the Python baseline of
    bench/finetune.py drifting from the job's history rule."""
    log = _log()
    assert _spark_histories(spark, log) == EXPECTED
    assert _python_histories(log, tmp_path) == EXPECTED
