"""``chatpipe top``'s arithmetic without a stack: percentiles from bucket deltas (what Prometheus'
``histogram_quantile`` gives), rates and lag from two scrapes of fake /metrics pages, and the drawn
frame. The real stack is in tests/infra/test_stack_full.py."""

from __future__ import annotations

import math

import pytest
from rich.console import Console

from clients.histograms import delta, quantile
from clients.top import Sampler, Target
from clients.top_view import render

INF = math.inf


def test_quantile_interpolates_inside_the_bucket_like_histogram_quantile():
    """Guards against an off-by-one bucket (p50 read as the bucket's upper bound) or a missing
    interpolation: 10 observations, 4 <= 0.1 s, 8 <= 0.5 s, 10 <= 1 s."""
    buckets = [(0.1, 4), (0.5, 8), (1.0, 10), (INF, 10)]
    assert quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (5 - 4) / 4)  # rank 5 in (0.1, 0.5]
    assert quantile(0.95, buckets) == pytest.approx(0.5 + 0.5 * (9.5 - 8) / 2)
    assert quantile(0.2, buckets) == pytest.approx(0.1 * 2 / 4)  # the first bucket starts at 0
    assert quantile(1.0, buckets) == pytest.approx(1.0)


def test_quantile_in_the_inf_bucket_is_the_highest_finite_bound_and_empty_is_none():
    """Guards against an infinite p95 when observations passed the last bound, and a 0 s figure shown
    for a histogram that has seen nothing."""
    assert quantile(0.95, [(1.0, 1), (60.0, 2), (INF, 10)]) == 60.0
    assert quantile(0.5, [(1.0, 0), (INF, 0)]) is None
    assert quantile(0.5, []) is None
    with pytest.raises(ValueError):
        quantile(1.5, [(1.0, 1), (INF, 1)])


def test_bucket_delta_is_what_was_observed_between_two_scrapes_and_survives_a_restart():
    """Guards against percentiles of the service's whole life shown as the window's, and negative
    counts after a restart (counters begin again at 0)."""
    old = {0.1: 10, 0.5: 10, INF: 10}  # ten fast requests before the window
    new = {0.1: 10, 0.5: 14, INF: 14}  # four slower ones within it
    window = delta(new, old)
    assert window == [(0.1, 0), (0.5, 4), (INF, 4)]
    assert 0.1 < quantile(0.5, window) <= 0.5  # the lifetime p50 would be under 0.1
    assert delta({0.1: 1, INF: 1}, old) == [(0.1, 1), (INF, 1)]  # restarted: the new scrape alone


def _page(requests: float, tokens: float, ttft: dict[str, float], lag: float, lag_s: float, kv: float) -> str:
    lines = [
        "# TYPE chatpipe_worker_requests counter",
        f'chatpipe_worker_requests_total{{outcome="stop"}} {requests}',
        "# TYPE chatpipe:generation_tokens counter",
        f'chatpipe:generation_tokens_total{{model_name="m"}} {tokens}',
        "# TYPE chatpipe:time_to_first_token_seconds histogram",
        *[f'chatpipe:time_to_first_token_seconds_bucket{{le="{le}",model_name="m"}} {n}' for le, n in ttft.items()],
        f'chatpipe:time_to_first_token_seconds_count{{model_name="m"}} {ttft["+Inf"]}',
        'chatpipe:time_to_first_token_seconds_sum{model_name="m"} 1.0',
        "# TYPE chatpipe:kv_cache_usage_perc gauge",
        f'chatpipe:kv_cache_usage_perc{{model_name="m"}} {kv}',
        "# TYPE chatpipe:num_requests_waiting gauge",
        'chatpipe:num_requests_waiting{model_name="m"} 3.0',
        "# TYPE chatpipe_consumer_lag_records gauge",
        f'chatpipe_consumer_lag_records{{group="g",topic="chat.inference.requests"}} {lag}',
        'chatpipe_consumer_lag_records{group="g.batch",topic="chat.inference.requests.batch"} -1',
        "# TYPE chatpipe_consumer_lag_seconds gauge",
        f'chatpipe_consumer_lag_seconds{{group="g",topic="chat.inference.requests"}} {lag_s}',
        'chatpipe_consumer_lag_seconds{group="g.batch",topic="chat.inference.requests.batch"} -1',
    ]
    return "\n".join(lines) + "\n"


def test_two_scrapes_give_rates_window_percentiles_and_each_groups_largest_lag():
    """Guards against rates from one scrape, a group's lag counted once per member (two workers of one
    group report it alike), and "not known" (-1) shown as a number."""
    now = [100.0]
    pages = {
        "inference": [_page(10, 500, {"0.1": 2, "0.5": 2, "1.0": 2, "+Inf": 2}, 4, 2.5, 0.25),
                      _page(14, 700, {"0.1": 2, "0.5": 5, "1.0": 6, "+Inf": 6}, 4, 2.5, 0.5)],
        "inference-2": [_page(0, 0, {"+Inf": 0}, 6, 3.0, 0.0), _page(0, 0, {"+Inf": 0}, 6, 3.0, 0.0)],
    }
    calls = {name: iter(p) for name, p in pages.items()}
    targets = [Target("inference", "inference", "http://inference"), Target("inference-2", "inference", "http://i2"),
               Target("kafka", "kafka", None, pid=42), Target("gateway", "gateway", "http://gone")]

    def fetch(url):
        name = {"http://inference": "inference", "http://i2": "inference-2"}.get(url)
        if name is None:
            raise ConnectionRefusedError("refused")
        return next(calls[name])

    sampler = Sampler(targets, window_s=10, fetch=fetch, clock=lambda: now[0])
    sampler.sample()
    now[0] += 2.0
    sampler.sample()
    frame = sampler.frame()
    rows = {r.name: r for r in frame.rows}
    worker = rows["inference"]
    assert frame.window_s == pytest.approx(2.0)
    assert worker.requests == 14 and worker.req_s == pytest.approx(2.0) and worker.tok_s == pytest.approx(100.0)
    assert 0.1 < worker.ttft[0] <= 0.5 and 0.5 < worker.ttft[1] <= 1.0 and not worker.latency_since_start
    assert worker.kv == 0.5 and worker.waiting == 3 and worker.backlog == 4  # the -1 of g.batch left out
    assert rows["inference-2"].ttft == (None, None) and rows["inference-2"].tok_s == 0
    assert rows["kafka"].state == "running" and rows["gateway"].state == "no /metrics"
    lags = {(lag.group, lag.topic): lag for lag in frame.lags}
    assert lags[("g", "chat.inference.requests")].records == 6  # the largest report, not 4 + 6
    assert lags[("g", "chat.inference.requests")].seconds == 3.0
    assert lags[("g", "chat.inference.requests")].reporters == ("inference", "inference-2")
    assert lags[("g.batch", "chat.inference.requests.batch")].records is None

    console = Console(width=160, record=True)
    console.print(render(frame, "/state"))
    screen = console.export_text()
    for text in ("inference-2", "no /metrics", "TTFT p95", "100.0", "50%", "consumer lag", "chat.inference.requests"):
        assert text in screen, text


def test_a_streams_row_shows_the_response_cache_hit_ratio_of_the_window_else_since_the_start():
    """Guards against the ratio of the whole life shown for the window, and a ratio over bypassed prompts
    (they are not cacheable: hits / (hits + misses) only)."""
    def page(hits: float, misses: float) -> str:
        return ("# TYPE chatpipe_streams_response_cache_hits counter\n"
                f'chatpipe_streams_response_cache_hits_total{{tenant="acme"}} {hits}\n'
                f'chatpipe_streams_response_cache_hits_total{{tenant="globex"}} {hits}\n'
                "# TYPE chatpipe_streams_response_cache_misses counter\n"
                f'chatpipe_streams_response_cache_misses_total{{tenant="acme"}} {misses}\n'
                "# TYPE chatpipe_streams_response_cache_bypasses counter\n"
                'chatpipe_streams_response_cache_bypasses_total{tenant="acme",reason="sampled"} 500\n')

    def note(first: str, second: str) -> str:
        now, pages = [0.0], iter([first, second])
        sampler = Sampler([Target("streams", "streams", "http://s")], fetch=lambda url: next(pages),
                          clock=lambda: now[0])
        sampler.sample()
        now[0] += 1.0
        sampler.sample()
        return sampler.frame().rows[0].notes

    assert "cache hit 75%" in note(page(10, 100), page(13, 102))  # 6 hits, 2 misses in the window
    assert "cache hit 20%" in note(page(1, 8), page(1, 8))  # nothing in the window: 2 of 10 since the start
