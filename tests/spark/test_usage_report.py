"""The usage report over the planted log: figures per day and model, and per tenant, match a count in
Python."""

from __future__ import annotations

import copy
import statistics
import zlib
from dataclasses import replace
from datetime import datetime, timezone

import pandas as pd
import pytest

from chatpipe.testing.synthetic_log import CURRENT_TURN_VERSION, to_messages, writer_version
from spark_jobs.settings import UsageReportSettings
from transport.archive import write_messages

pytestmark = pytest.mark.spark


TENANTS = ("acme", "globex", "initech")


def with_tenants_and_cached_tokens(planted_log):
    """The planted log with three tenants (by event id: a turn's copies stay alike) and prompt tokens
    from the prefix cache: half of each acme and globex turn's (0 for initech). Turns written before
    ConversationTurn v5 (v1, and v2 without a trace id) lose them on the way: they read 0."""
    log = copy.copy(planted_log)
    log.turns = []
    for t in planted_log.turns:
        tenant = TENANTS[zlib.crc32(t.event_id.encode()) % len(TENANTS)]
        log.turns.append(replace(t, tenant=tenant, cached_tokens=0 if tenant == "initech" else t.tokens_in // 2))
    return log


def test_usage_report_figures(spark, planted_log, tmp_path):
    """Catches wrong grouping (day/model), token sums, error counts, active users (a user is (tenant,
    user_id)), a v1 turn's missing TTFT counted as 0 ms, undecodable turns not reported, and per tenant
    the cached share (issue 43: sum cached_tokens / sum tokens_in) wrong, or counting turns before v5
    as anything but 0."""
    from spark_jobs.usage_report import run
    from transport.settings import KafkaSettings

    planted_log = with_tenants_and_cached_tokens(planted_log)
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
        assert row["active_users"] == len({(t.tenant, t.user_id) for t in turns})
        v2 = [t.ttft_ms for t in turns if t.event_id not in planted_log.v1_event_ids]
        assert row["ttft_p50_ms"] == pytest.approx(statistics.median(v2), rel=1e-6)
    tenants = pd.read_parquet(out / "tenants.parquet").set_index("tenant")
    assert sorted(tenants.index) == sorted(TENANTS)
    for tenant in TENANTS:
        turns = [t for t in planted_log.turns if t.tenant == tenant]
        v5 = [t for t in turns if writer_version(t, t.event_id in planted_log.v1_event_ids) == CURRENT_TURN_VERSION]
        assert 0 < len(v5) < len(turns)  # both kinds, or the test could not tell them apart
        row, tokens_in, cached = tenants.loc[tenant], sum(t.tokens_in for t in turns), sum(t.cached_tokens for t in v5)
        assert (row["requests"], row["tokens_in"], row["cached_tokens"]) == (len(turns), tokens_in, cached)
        assert row["cached_share"] == pytest.approx(cached / tokens_in)
    assert tenants.loc["initech", "cached_share"] == 0 and tenants.loc["acme", "cached_share"] > 0
    report = (out / "usage_report.md").read_text()
    acme = [int(tenants.loc["acme", c]) for c in ("requests", "tokens_in", "tokens_out", "cached_tokens")]
    assert f"| acme | {' | '.join(map(str, acme))} | {acme[3] / acme[1]:.1%} |" in report, report
    dlq = pd.read_parquet(out / "dlq.parquet")
    assert dlq[dlq["component"] == "undecodable chat.turns"]["dead_letters"].sum() == len(planted_log.junk_turn_values)
    assert {"requests.png", "tokens.png", "latency_p95.png", "usage_report.md"} <= {p.name for p in out.iterdir()}
