"""The usage report over the planted log: figures per day and model match a count in Python."""

from __future__ import annotations

import statistics
from datetime import datetime, timezone

import pandas as pd
import pytest

from chatpipe.testing.synthetic_log import to_messages
from spark_jobs.settings import UsageReportSettings
from transport.archive import write_messages

pytestmark = pytest.mark.spark


def test_usage_report_figures(spark, planted_log, tmp_path):
    """Catches wrong grouping (day/model), token sums, error counts, active users, a v1 turn's
    missing TTFT counted as 0 ms, and undecodable turns not reported."""
    from spark_jobs.usage_report import run
    from transport.settings import KafkaSettings

    write_messages(tmp_path / "archive", to_messages(planted_log, "chat.turns", "chat.feedback"))
    out = run(spark, UsageReportSettings(source="archive", archive_dir=tmp_path / "archive", out=tmp_path / "r"),
              KafkaSettings())
    usage = pd.read_parquet(out / "usage.parquet").set_index(["day", "model"])
    day = lambda ms: datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d")
    groups: dict = {}
    for t in planted_log.turns:
        groups.setdefault((day(t.created_at), t.model), []).append(t)
    assert len(usage) == len(groups)
    for key, turns in groups.items():
        row = usage.loc[key]
        assert row["requests"] == len(turns)
        assert row["tokens_out"] == sum(t.tokens_out for t in turns)
        assert row["errors"] == sum(t.finish_reason in ("ERROR", "TIMEOUT", "OVERLOADED") for t in turns)
        assert row["active_users"] == len({t.user_id for t in turns})
        v2 = [t.ttft_ms for t in turns if t.event_id not in planted_log.v1_event_ids]
        assert row["ttft_p50_ms"] == pytest.approx(statistics.median(v2), rel=1e-6)
    dlq = pd.read_parquet(out / "dlq.parquet")
    assert dlq[dlq["component"] == "undecodable chat.turns"]["dead_letters"].sum() == len(planted_log.junk_turn_values)
    assert {"requests.png", "tokens.png", "latency_p95.png", "usage_report.md"} <= {p.name for p in out.iterdir()}
