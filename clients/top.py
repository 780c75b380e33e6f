"""What ``chatpipe top`` shows: the live pipeline, from every service's own ``/metrics``.

No Prometheus server is needed: each refresh scrapes every running service (gateway, inference
workers, streams workers) in parallel, keeps the scrapes of the last ``window_s`` seconds, and
derives from the oldest and the newest one, per service: requests/s and tokens/s (counter
deltas), TTFT and TPOT p50/p95 (bucket deltas, ``histograms.py``), what runs and waits, the
backlog its consumer groups have on Kafka, KV-cache use; and per consumer group the lag in
records and seconds (``chatpipe_consumer_lag_*``, which every member of a group reports alike:
the largest value is shown). When no request finished within the window, the latencies are
those since the service started, marked as such.

Which metrics each kind of service has is in ``SPECS`` (names as docs/observability.md lists
them). Rendering is ``top_view.py``; finding the services is the CLI's (``chatpipe/commands/top.py``).
"""

from __future__ import annotations

import collections
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

from clients.histograms import delta, quantile

_no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
Labels = tuple[tuple[str, str], ...]  # (label, value) pairs a sample must have


@dataclass(frozen=True, slots=True)
class Target:
    name: str  # the service: gateway, inference, inference-2, streams, kafka, ...
    kind: str  # gateway | inference | streams | anything else (shown, not scraped)
    url: str | None  # its /metrics; None: it has none (Kafka)
    pid: int | None = None


@dataclass(frozen=True, slots=True)
class Spec:
    """The metric names a kind of service reports what ``top`` shows with (None: it has none)."""

    requests: str | None = None  # a counter: requests taken (any outcome)
    requests_labels: Labels = ()  # only these samples of it
    tokens: str | None = None  # a counter of tokens (or a histogram's _sum)
    ttft: str | None = None  # histograms (base names)
    tpot: str | None = None
    running: str | None = None  # gauges
    waiting: str | None = None
    kv: str | None = None


SPECS = {
    "inference": Spec("chatpipe_worker_requests_total", (), "chatpipe:generation_tokens_total",
                      "chatpipe:time_to_first_token_seconds", "chatpipe:request_time_per_output_token_seconds",
                      "chatpipe:num_requests_running", "chatpipe:num_requests_waiting", "chatpipe:kv_cache_usage_perc"),
    "gateway": Spec("chatpipe_gateway_requests_total", (), "chatpipe_gateway_completion_tokens_total",
                    "chatpipe_gateway_ttft_seconds", None, "chatpipe_gateway_pending"),
    # streams: prompts turned into inference requests, and the prompt tokens it assembled for them
    "streams": Spec("chatpipe_streams_records_total", (("agent", "intake"), ("outcome", "ok")),
                    "chatpipe_streams_assembled_prompt_tokens_sum"),
}
LAG_RECORDS, LAG_SECONDS = "chatpipe_consumer_lag_records", "chatpipe_consumer_lag_seconds"


class Scrape:
    """One ``/metrics`` page, parsed: sample name -> [(labels, value)]."""

    def __init__(self, text: str, at: float) -> None:
        self.at = at
        self.samples: dict[str, list[tuple[dict[str, str], float]]] = collections.defaultdict(list)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.samples[sample.name].append((sample.labels, sample.value))

    def total(self, name: str | None, match: Labels = ()) -> float | None:
        """The sum of ``name``'s samples whose labels include ``match``; None when it has none."""
        if name is None or name not in self.samples:
            return None
        return sum(v for labels, v in self.samples[name] if all(labels.get(k) == w for k, w in match))

    def buckets(self, histogram: str) -> dict[float, float]:
        """``{le: cumulative count}`` of a histogram, summed over its other labels."""
        out: dict[float, float] = collections.defaultdict(float)
        for labels, value in self.samples.get(f"{histogram}_bucket", ()):
            out[float(labels["le"])] += value
        return dict(out)

    def labelled(self, name: str) -> list[tuple[dict[str, str], float]]:
        return self.samples.get(name, [])


def fetch(url: str, timeout_s: float = 2.0) -> str:
    with _no_proxy.open(url, timeout=timeout_s) as reply:
        return reply.read().decode()


@dataclass(slots=True)
class ServiceRow:
    name: str
    kind: str
    state: str  # "up" | "no /metrics" (runs, its page does not answer) | "running" (nothing to scrape)
    pid: int | None = None
    requests: float | None = None  # since the service started
    req_s: float | None = None
    tok_s: float | None = None
    ttft: tuple[float | None, float | None] | None = None  # (p50, p95) seconds
    tpot: tuple[float | None, float | None] | None = None
    latency_since_start: bool = False  # no request finished within the window: the lifetime figures
    running: float | None = None
    waiting: float | None = None
    backlog: float | None = None  # records its consumer groups have not done yet
    kv: float | None = None  # 0..1
    notes: str = ""


@dataclass(frozen=True, slots=True)
class LagRow:
    group: str
    topic: str
    records: float | None  # None: not known (-1 from the service)
    seconds: float | None
    reporters: tuple[str, ...]


@dataclass(slots=True)
class Frame:
    at: float
    window_s: float  # the span the rates and percentiles cover (0: one scrape so far)
    rows: list[ServiceRow] = field(default_factory=list)
    lags: list[LagRow] = field(default_factory=list)


class Sampler:
    """Scrapes ``targets`` on each ``sample()``, keeps ``window_s`` of history, makes ``Frame``s."""

    def __init__(self, targets: list[Target], window_s: float = 10.0,
                 fetch: Callable[[str], str] = fetch, clock: Callable[[], float] = time.time) -> None:
        self.targets = targets
        self.window_s = window_s
        self.fetch = fetch
        self.clock = clock
        self.history: dict[str, collections.deque[Scrape]] = {t.name: collections.deque() for t in targets}
        self.errors: dict[str, str] = {}

    def set_targets(self, targets: list[Target]) -> None:
        """The services found now (a worker added or gone); the history of those still there is kept."""
        self.targets = targets
        self.history = {t.name: self.history.get(t.name, collections.deque()) for t in targets}

    def sample(self) -> None:
        scraped = [t for t in self.targets if t.url]
        if not scraped:
            return
        with ThreadPoolExecutor(max_workers=min(8, len(scraped))) as pool:
            pages = list(pool.map(self._get, scraped))
        for target, page in zip(scraped, pages):
            if page is None:
                continue
            history = self.history[target.name]
            history.append(page)
            while len(history) > 2 and page.at - history[1].at >= self.window_s:
                history.popleft()  # keep one scrape at least window_s old: the window's start

    def _get(self, target: Target) -> Scrape | None:
        try:
            page = Scrape(self.fetch(target.url), self.clock())
        except Exception as exc:  # noqa: BLE001 - refused, timed out, half a page: shown in its row
            self.errors[target.name] = f"{type(exc).__name__}: {exc}"
            return None
        self.errors.pop(target.name, None)
        return page

    def frame(self) -> Frame:
        frame = Frame(self.clock(), 0.0)
        for target in self.targets:
            history = self.history[target.name]
            if target.url is None:
                frame.rows.append(ServiceRow(target.name, target.kind, "running", target.pid))
                continue
            if not history or target.name in self.errors:
                frame.rows.append(ServiceRow(target.name, target.kind, "no /metrics", target.pid,
                                             notes=self.errors.get(target.name, "")))
                continue
            old, new = (history[0] if len(history) > 1 else None), history[-1]
            if old is not None:
                frame.window_s = max(frame.window_s, new.at - old.at)
            frame.rows.append(service_row(target, SPECS.get(target.kind, Spec()), old, new))
        frame.lags = lag_rows({t.name: self.history[t.name][-1] for t in self.targets
                               if self.history[t.name] and t.name not in self.errors})
        return frame


def _rate(name: str | None, old: Scrape | None, new: Scrape, match: Labels = ()) -> float | None:
    after = new.total(name, match)
    if after is None or old is None or new.at <= old.at:
        return None
    before = old.total(name, match) or 0.0  # a labelled counter has no sample before its first count
    if after < before:  # restarted in between: counting began again
        before = 0.0
    return (after - before) / (new.at - old.at)


def _percentiles(histogram: str | None, old: Scrape | None, new: Scrape) -> tuple[tuple | None, bool]:
    """((p50, p95) of the window, False), or of the service's whole life with True when nothing was
    observed within the window; (None, False) when the service has no such histogram."""
    if histogram is None or f"{histogram}_bucket" not in new.samples:
        return None, False
    now = new.buckets(histogram)
    window = delta(now, old.buckets(histogram) if old is not None else None)
    if window and window[-1][1] > 0:
        return (quantile(0.5, window), quantile(0.95, window)), False
    lifetime = sorted(now.items())
    if lifetime and lifetime[-1][1] > 0:
        return (quantile(0.5, lifetime), quantile(0.95, lifetime)), True
    return (None, None), False


def service_row(target: Target, spec: Spec, old: Scrape | None, new: Scrape) -> ServiceRow:
    row = ServiceRow(target.name, target.kind, "up", target.pid)
    row.requests = new.total(spec.requests, spec.requests_labels)
    row.req_s = _rate(spec.requests, old, new, spec.requests_labels)
    row.tok_s = _rate(spec.tokens, old, new)
    row.ttft, since_ttft = _percentiles(spec.ttft, old, new)
    row.tpot, since_tpot = _percentiles(spec.tpot, old, new)
    row.latency_since_start = since_ttft or since_tpot
    row.running, row.waiting, row.kv = new.total(spec.running), new.total(spec.waiting), new.total(spec.kv)
    lags = [v for _, v in new.labelled(LAG_RECORDS) if v >= 0]
    row.backlog = sum(lags) if lags else None
    row.notes = _notes(target.kind, old, new)
    return row


def _notes(kind: str, old: Scrape | None, new: Scrape) -> str:
    """A few figures of the kind's own (k9s' extra columns, folded into one)."""
    parts = []
    if kind == "inference":
        state = next((labels.get("chatpipe_worker_state") for labels, v in new.labelled("chatpipe_worker_state")
                      if v == 1), None)
        if state:
            parts.append(state)
        prefix_cache = ("chatpipe:prefix_cache_hits_total", "chatpipe:prefix_cache_queries_total")
        hits, queries = (_rate(n, old, new) for n in prefix_cache)
        if not queries:  # nothing admitted in the window: since the start
            hits, queries = (new.total(n) for n in prefix_cache)
        if queries:
            parts.append(f"prefix hit {100 * (hits or 0) / queries:.0f}%")
    elif kind == "streams":
        held = new.total("chatpipe_streams_conversations")
        if held is not None:
            parts.append(f"{held:.0f} conversations")
        cache = ("chatpipe_streams_response_cache_hits_total", "chatpipe_streams_response_cache_misses_total")
        hits, misses = (_rate(n, old, new) for n in cache)
        if not (hits or misses):  # no cacheable prompt in the window: since the start
            hits, misses = (new.total(n) for n in cache)
        if hits or misses:  # the response cache's hit ratio (streams/response_cache.py): of cacheable prompts
            parts.append(f"cache hit {100 * (hits or 0) / ((hits or 0) + (misses or 0)):.0f}%")
        recall, _ = _percentiles("chatpipe_streams_recall_seconds", old, new)
        if recall is not None and recall[0] is not None:
            parts.append(f"recall p50 {recall[0] * 1000:.1f} ms")
        letters = new.total("chatpipe_streams_dead_letters_total")
        if letters:
            parts.append(f"{letters:.0f} dead letters")
    elif kind == "gateway":
        rejected = sum(v for labels, v in new.labelled("chatpipe_gateway_requests_total")
                       if labels.get("outcome") != "ok")
        ok = new.total("chatpipe_gateway_requests_total", (("outcome", "ok"),))
        if ok is not None:
            parts.append(f"{ok:.0f} ok, {rejected:.0f} not")
    return " · ".join(parts)


def lag_rows(latest: dict[str, Scrape]) -> list[LagRow]:
    """Per (group, topic): the largest lag any service reports (a group's members report alike)."""
    found: dict[tuple[str, str], dict] = {}
    for service, scrape in latest.items():
        seconds = {(labels.get("group", ""), labels.get("topic", "")): v for labels, v in scrape.labelled(LAG_SECONDS)}
        for labels, records in scrape.labelled(LAG_RECORDS):
            key = (labels.get("group", ""), labels.get("topic", ""))
            entry = found.setdefault(key, {"records": None, "seconds": None, "reporters": []})
            if records >= 0:
                entry["records"] = max(entry["records"] or 0.0, records)
            if seconds.get(key, -1) >= 0:
                entry["seconds"] = max(entry["seconds"] or 0.0, seconds[key])
            entry["reporters"].append(service)
    return [LagRow(g, t, e["records"], e["seconds"], tuple(e["reporters"])) for (g, t), e in sorted(found.items())]
