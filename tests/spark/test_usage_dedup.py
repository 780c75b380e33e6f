"""The usage report counts a record delivered more than once once (dedup by event_id)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from datetime import datetime, timezone

import pandas as pd
import pytest

from chatpipe.testing.synthetic_log import START_MS, generate, to_messages
from schemas.codec import AvroCodec
from schemas.records import DeadLetter
from spark_jobs.settings import UsageReportSettings
from transport.archive import ArchivedMessage, write_messages

pytestmark = pytest.mark.spark


def _day(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d")


def test_redelivered_turns_and_dead_letters_are_counted_once(spark, tmp_path):
    """Catches requests, tokens and dead letters inflated by at-least-once redelivery: the same
    turn (same event_id) archived twice at another offset must count once, as in the dataset job."""
    from spark_jobs.usage_report import run
    from transport.settings import KafkaSettings

    log = generate(n_turns=40, seed=21, planted=False)
    msgs = to_messages(log, "chat.turns", "chat.feedback", partitions=2)
    turns = [m for m in msgs if m.topic == "chat.turns"]
    next_offset = Counter()
    for m in msgs:
        next_offset[(m.topic, m.partition)] = max(next_offset[(m.topic, m.partition)], m.offset + 1)
    copies = []
    for m in turns[::4]:  # every 4th turn delivered again, later, at the next offset of its partition
        copies.append(replace(m, offset=next_offset[(m.topic, m.partition)], timestamp=m.timestamp + 1000))
        next_offset[(m.topic, m.partition)] += 1
    codec = AvroCodec()
    dead = DeadLetter(event_id="dl-1", error_type="DecodeError", error_message="x", component="streams",
                      created_at=START_MS + 5000)
    dlq = [ArchivedMessage("chat.dlq", 0, i, START_MS + 5000 + i, b"k", codec.encode(dead)) for i in range(3)]
    write_messages(tmp_path / "archive", msgs + copies + dlq)

    out = run(spark, UsageReportSettings(source="archive", archive_dir=tmp_path / "archive", out=tmp_path / "r",
                                         charts=False), KafkaSettings())
    usage = pd.read_parquet(out / "usage.parquet")
    assert copies and usage["requests"].sum() == len(log.turns)
    expected = Counter((_day(t.created_at), t.model) for t in log.turns)
    assert {(r.day, r.model): r.requests for r in usage.itertuples()} == dict(expected)
    assert usage["tokens_out"].sum() == sum(t.tokens_out for t in log.turns)
    dl = pd.read_parquet(out / "dlq.parquet")
    assert dl[dl["component"] == "streams"]["dead_letters"].sum() == 1
