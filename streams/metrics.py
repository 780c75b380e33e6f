"""Prometheus metrics of one streams worker: ``/metrics`` on ``StreamsSettings.metrics_port`` (0 = off).

Served by prometheus-client's own HTTP server in a thread (Faust's web server is off by default
and would tie the endpoint to it), on a registry of its own. Two kinds of metric:

- observed where the work happens (the intake agent): prompts per batch, the embedding and recall
  calls of a run, the tokens of each assembled prompt;
- read at scrape time from the counters the agents keep anyway (``AgentCounters``): records by
  agent and outcome, dead letters by reason, retries of the infrastructure, conversations held
  in the table. Nothing is counted twice, and the agents carry no metrics code for them.

Plus the lag of the Faust consumer group on its source topics (``transport.lag``), measured
every ``lag_interval_s`` while the endpoint is served: ``chatpipe_consumer_lag_records`` and
``_seconds``, the names the inference worker uses for its groups.
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from transport.lag import GroupTopics, LagMonitor, TopicLag
from transport.settings import KafkaSettings

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Recall waits at most recall_timeout_s (2 s); the buckets past it are for slow embedding calls.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0, 300.0)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class StreamsMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.intake_batch_size = Histogram("chatpipe_streams_intake_batch_size", "Prompts per intake batch",
                                           buckets=BATCH_BUCKETS, registry=r)
        self.embed_seconds = Histogram("chatpipe_streams_embed_seconds",
                                       "One embedding call for a run of an intake batch", buckets=LATENCY_BUCKETS,
                                       registry=r)
        self.recall_seconds = Histogram("chatpipe_streams_recall_seconds",
                                        "One memory recall call for a run of an intake batch (retries included)",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.assembled_tokens = Histogram("chatpipe_streams_assembled_prompt_tokens",
                                          "Tokens of each assembled prompt (InferenceRequest.context_tokens)",
                                          buckets=TOKEN_BUCKETS, registry=r)
        self.cache_hit_seconds = Histogram("chatpipe_streams_response_cache_hit_seconds",
                                           "From intake taking the batch to a cached answer's chunk on the "
                                           "broker", buckets=LATENCY_BUCKETS, registry=r)
        self.lag_records = Gauge("chatpipe_consumer_lag_records", "Records of the topic not yet done by the group "
                                 "(end - committed)", ["group", "topic"], registry=r)
        self.lag_seconds = Gauge("chatpipe_consumer_lag_seconds", "Age of the oldest record not yet done by the "
                                 "group (0: none waiting)", ["group", "topic"], registry=r)
        # Per model version (streams/version_agent.py): what the rollout rule decides on
        self.version = Gauge("chatpipe_model_version", "Per model version since the oldest canary started: turns, "
                             "rated turns, thumbs_up_rate, error_rate, regenerate_rate, edit_rate, ttft_s (mean), "
                             "tokens_per_s", ["model", "figure"], registry=r)
        self._lag: LagMonitor | None = None

    def version_stats(self, stats: Any) -> None:
        from streams.version_agent import describe

        for figure, value in describe(stats).items():
            self.version.labels(stats.model, figure).set(value)

    def serve(self, port: int, kafka: KafkaSettings, groups: Iterable[GroupTopics], lag_interval_s: float = 5.0,
              host: str = "127.0.0.1") -> None:
        if not port:
            return
        start_http_server(port, addr=host, registry=self.registry)
        self._lag = LagMonitor(kafka, groups, self.lags, interval_s=lag_interval_s)
        self._lag.start()

    def lags(self, lags: Iterable[TopicLag]) -> None:
        for lag in lags:  # -1: not known (the broker could not be asked)
            self.lag_records.labels(lag.group, lag.topic).set(-1 if lag.records is None else lag.records)
            self.lag_seconds.labels(lag.group, lag.topic).set(-1 if lag.seconds is None else lag.seconds)

    def close(self) -> None:
        if self._lag is not None:
            self._lag.close()


class AgentCounters:
    """A collector over the agents' own counters (read, never reset: Prometheus counters)."""

    def __init__(self, streams: Any) -> None:
        self.streams = streams

    def collect(self):
        s = self.streams
        records = CounterMetricFamily("chatpipe_streams_records", "Records handled, by agent and outcome",
                                      labels=["agent", "outcome"])
        intake_letters = s.refusals.dead_letters
        for agent, outcome, value in (
            ("intake", "ok", s.intake.served),  # an InferenceRequest produced
            ("intake", "repeat", s.intake.repeats),  # answered already (read again after a restart)
            ("intake", "refused", intake_letters.count - intake_letters.undecodable),  # answered with the reason
            ("intake", "dead_letter", intake_letters.undecodable),
            ("record", "ok", s.record.recorded),  # a turn
            ("record", "duplicate", s.record.duplicates),
            ("record", "erased", s.record.erased),
            ("record", "dead_letter", s.record.dead_letters.count),
            ("forget", "ok", s.forget.fanned_out),
            ("forget_partition", "ok", s.forget_partition.carried_out),
            ("forget", "dead_letter", s.forget.dead_letters.count),
            ("archive", "ok", s.archiver.archived),
            ("archive", "duplicate", s.archiver.duplicates),
            ("archive", "erased", s.archiver.erased),
            ("archive", "skipped", s.archiver.skipped),  # offsets archived already (a redelivery)
            ("table", "expired", s.expiry.expired),  # idle conversations removed (expiry.py)
            ("memory_writer", "ok", s.memory_writer.upserted),  # turns embedded and upserted into memory
            ("memory_writer", "not_remembered", s.memory_writer.not_remembered),  # failed answers, raw prompts
            ("memory_writer", "erased", s.memory_writer.erased),  # of a user or conversation forgotten meanwhile
            ("memory_writer", "undecodable", s.memory_writer.undecodable),
        ):
            records.add_metric([agent, outcome], value)
        yield records
        degraded = CounterMetricFamily("chatpipe_streams_memory_degraded_prompts", "Prompts served without recalled "
                                       "memory: recall did not answer within recall_timeout_s (Qdrant slow or away)")
        degraded.add_metric([], s.intake.memory_degraded)
        yield degraded
        letters = CounterMetricFamily("chatpipe_streams_dead_letters", "Dead letters sent, by component and reason",
                                      labels=["component", "reason"])
        for dead in {id(d): d for d in (intake_letters, s.record.dead_letters, s.forget.dead_letters)}.values():
            for reason, n in sorted(dead.reasons.items()):
                letters.add_metric([dead.component, reason], n)
        yield letters
        retries = CounterMetricFamily("chatpipe_streams_retries", "Infrastructure calls retried (Qdrant, the broker, "
                                      "the archive's disk), by retry budget", labels=["budget"])
        retries.add_metric(["records"], s.intake.retrier.retries)
        retries.add_metric(["archive"], s.archive.retrier.retries)
        retries.add_metric(["memory_writer"], s.memory_writer.retrier.retries)
        retries.add_metric(["recall"], s.intake.recall_retrier.retries)
        yield retries
        if s.intake.cache is not None:
            yield from cache_metrics(s.intake.cache, s.cache_info)
        held = GaugeMetricFamily("chatpipe_streams_conversations", "Conversation states held in the table (this "
                                 "worker's partitions)")
        held.add_metric([], _size(s.table))
        yield held


def cache_metrics(cache: Any, info: Any) -> Iterable[Any]:
    """The response cache's counters (streams/response_cache.py), per tenant; and from the server (``info``,
    Redis INFO read at scrape time, None when it did not answer) its bytes used and keys evicted."""
    hits = CounterMetricFamily("chatpipe_streams_response_cache_hits", "Prompts answered from the response cache",
                               labels=["tenant"])
    misses = CounterMetricFamily("chatpipe_streams_response_cache_misses", "Cacheable prompts not in the "
                                 "response cache (sent to a worker; their answers are stored)", labels=["tenant"])
    for family, counts in ((hits, cache.hits), (misses, cache.misses)):
        for tenant, n in sorted(counts.items()):
            family.add_metric([tenant], n)
    bypasses = CounterMetricFamily("chatpipe_streams_response_cache_bypasses", "Prompts that did not use the "
                                   "response cache, by reason: sampled (temperature > 0, no seed), n, logprobs, "
                                   "opted_out, unavailable (Redis away)", labels=["tenant", "reason"])
    for (tenant, reason), n in sorted(cache.bypasses.items()):
        bypasses.add_metric([tenant, reason], n)
    stores = CounterMetricFamily("chatpipe_streams_response_cache_stores", "Answers written to the response "
                                 "cache, by outcome", labels=["outcome"])
    stores.add_metric(["ok"], cache.stored)
    stores.add_metric(["failed"], cache.store_failures)
    hidden = CounterMetricFamily("chatpipe_streams_response_cache_hidden", "Entries found but not served: a "
                                 "retired model version, or an owner erased since")
    hidden.add_metric([], cache.hidden)
    yield from (hits, misses, bypasses, stores, hidden)
    server = info() if info is not None else None
    if server is not None:
        used = GaugeMetricFamily("chatpipe_response_cache_bytes", "Memory the cache's Redis uses (INFO used_memory)")
        used.add_metric([], server.get("used_memory", 0))
        evicted = CounterMetricFamily("chatpipe_response_cache_evictions", "Keys Redis evicted for maxmemory "
                                      "(INFO evicted_keys; the whole server's, allkeys-lru)")
        evicted.add_metric([], server.get("evicted_keys", 0))
        yield from (used, evicted)


def _size(table: Any) -> int:
    try:
        return len(table)
    except Exception:  # noqa: BLE001 - a table mid-recovery; the gauge must not break the scrape
        return 0
