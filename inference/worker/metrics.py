"""Prometheus metrics of one worker (prometheus-client), in a registry of its own so that several
workers in one process (tests) do not collide. ``serve(port, kafka, settings)`` exposes ``/metrics``
and starts measuring the lag of the worker's groups; port 0 = off.

The engine's metrics carry vLLM's names with ``chatpipe:`` in place of ``vllm:`` (and vLLM's
``model_name`` label, buckets and units), so a dashboard or alert written for vLLM reads them once
the prefix is swapped (docs/observability.md "Metrics"). What vLLM has no metric for keeps a
``chatpipe_worker_*`` name: the worker's state, its requests by outcome (dead letters and
hand-backs included, not only served ones), in flight, tokens/s. Consumer lag is the pipeline's
``chatpipe_consumer_lag_records`` / ``_seconds``, the same names the streams tier exposes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, make_wsgi_app, start_http_server

from transport.lag import GroupTopics, LagMonitor, TopicLag

if TYPE_CHECKING:
    from inference.worker.settings import WorkerSettings
    from transport.settings import KafkaSettings

# vLLM's buckets (vllm/v1/metrics/loggers.py): TTFT up to 2560 s, the per-token ones up to 80 s,
# request latencies (end to end, queue) up to 7680 s. A generation of minutes (a long answer on a
# CPU, a backlog) lands in a bucket, not in +Inf.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
STATES = ("STARTING", "SERVING", "DRAINING", "STOPPED", "FAILED")
# Our finish reasons -> vLLM's finished_reason values (stop, length, abort, error); timeout is ours.
FINISHED_REASON = {"STOP": "stop", "LENGTH": "length", "CANCELLED": "abort", "ERROR": "error", "TIMEOUT": "timeout"}


class WorkerMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        m = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, m, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, m, registry=r).labels(model_name)

        self.ttft = hist("chatpipe:time_to_first_token_seconds",
                         "Enqueued on Kafka -> first token (seconds)", TTFT_BUCKETS)
        self.itl = hist("chatpipe:inter_token_latency_seconds", "Time between two tokens of a request", TOKEN_BUCKETS)
        self.tpot = hist("chatpipe:request_time_per_output_token_seconds",
                         "Mean time per output token after the first, per request", TOKEN_BUCKETS)
        self.queue_time = hist("chatpipe:request_queue_time_seconds",
                               "Enqueued on Kafka -> admitted by the engine (seconds)", REQUEST_BUCKETS)
        self.e2e = hist("chatpipe:e2e_request_latency_seconds",
                        "Enqueued on Kafka -> answer complete (seconds)", REQUEST_BUCKETS)
        self.running = gauge("chatpipe:num_requests_running", "Requests running in the engine")
        self.waiting = gauge("chatpipe:num_requests_waiting", "Requests waiting in the engine's queue")
        self.kv_usage = gauge("chatpipe:kv_cache_usage_perc", "KV-cache usage, 1 = every block held by a request")
        self.prefix_queries = counter("chatpipe:prefix_cache_queries",
                                      "Prefix cache queries, in prompt tokens looked up")
        self.prefix_hits = counter("chatpipe:prefix_cache_hits", "Prefix cache hits, in tokens taken from the cache")
        self.preemptions = counter("chatpipe:num_preemptions", "Running requests sent back to the queue")
        self.fairness_preemptions = counter("chatpipe:num_fairness_preemptions", "Of the preemptions, those that "
                                            "gave a tenant under its fair share a slot")
        self.priority_preemptions = counter("chatpipe:num_priority_preemptions", "Of the preemptions, those of a "
                                            "batch request that made way for an interactive one")
        self.prompt_tokens = counter("chatpipe:prompt_tokens", "Prompt tokens of the requests served")
        self.generation_tokens = counter("chatpipe:generation_tokens", "Tokens generated")
        self.success = Counter("chatpipe:request_success", "Requests the engine finished, by finished_reason",
                               ["model_name", "finished_reason"], registry=r)
        self.tokens_per_s = Gauge("chatpipe_worker_tokens_per_second", "Generated tokens/s (engine, last seconds)",
                                  registry=r)
        self.in_flight = Gauge("chatpipe_worker_in_flight", "Requests taken and not yet answered", registry=r)
        self.requests = Counter("chatpipe_worker_requests", "Requests by outcome", ["outcome"], registry=r)
        self.lag_records = Gauge("chatpipe_consumer_lag_records", "Records of the topic not yet done by the group "
                                 "(consumer group: end - committed; share group: not yet acknowledged)",
                                 ["group", "topic"], registry=r)
        self.lag_seconds = Gauge("chatpipe_consumer_lag_seconds", "Age of the oldest record not yet done by the "
                                 "group (0: none waiting)", ["group", "topic"], registry=r)
        # A scraper must not read "serving" from a worker that has stopped consuming: FAILED from the
        # moment a thread it needs dies until the process exits.
        self.state = Enum("chatpipe_worker_state", "Worker state", states=list(STATES), registry=r)
        self._engine_seen = (0, 0, 0, 0, 0)  # queried, hits, preemptions, fairness, priority: the counters take deltas
        self._lag: LagMonitor | None = None

    def serve(self, port: int, kafka: KafkaSettings | None = None, settings: WorkerSettings | None = None,
              ready: Callable[[], tuple[bool, str]] | None = None) -> None:
        """``/metrics`` on ``port`` (0: off), and with ``kafka`` and ``settings`` the lag of the worker's
        groups measured every ``lag_interval_s`` (only while served: nobody else reads it). ``ready``:
        ``/ready`` answers 200 or 503 with its text (a pod's readiness: serving, and holding every version
        it must)."""
        if not port:
            return
        addr = settings.metrics_host if settings is not None else "127.0.0.1"
        if ready is None:
            start_http_server(port, addr=addr, registry=self.registry)
        else:
            serve_with_readiness(port, addr, make_wsgi_app(self.registry), ready)
        if kafka is not None and settings is not None:
            self._lag = LagMonitor(kafka, lag_groups(kafka, settings), self.lags, interval_s=settings.lag_interval_s)
            self._lag.start()

    def close(self) -> None:
        if self._lag is not None:
            self._lag.close()

    def token(self, gap_s: float | None) -> None:
        """One generated token; ``gap_s`` since the request's previous one (None for its first)."""
        self.generation_tokens.inc()
        if gap_s is not None:
            self.itl.observe(gap_s)

    def finished(self, finish_reason: str, *, queue_s: float, ttft_s: float | None, e2e_s: float,
                 tpot_s: float | None, prompt_tokens: int) -> None:
        """A request the engine ran to its end (any finish reason)."""
        self.success.labels(self.model_name, FINISHED_REASON.get(finish_reason, finish_reason.lower())).inc()
        self.queue_time.observe(max(0.0, queue_s))
        if ttft_s:
            self.ttft.observe(ttft_s)
        self.e2e.observe(max(0.0, e2e_s))
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        self.prompt_tokens.inc(prompt_tokens)

    def engine(self, stats, in_flight: int) -> None:
        """The engine's gauges, and its cumulative counts as counter increments (heartbeat)."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.kv_usage)
        self.tokens_per_s.set(stats.tokens_per_s)
        self.in_flight.set(in_flight)
        now = (stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens, stats.preemptions,
               stats.fairness_preemptions, stats.priority_preemptions)
        for counter, before, after in zip((self.prefix_queries, self.prefix_hits, self.preemptions,
                                           self.fairness_preemptions, self.priority_preemptions),
                                          self._engine_seen, now):
            if after > before:
                counter.inc(after - before)
        self._engine_seen = now

    def lags(self, lags: Iterable[TopicLag]) -> None:
        """The latest consumer lag of the worker's groups (``transport.lag.LagMonitor``); -1: not known."""
        for lag in lags:
            self.lag_records.labels(lag.group, lag.topic).set(-1 if lag.records is None else lag.records)
            self.lag_seconds.labels(lag.group, lag.topic).set(-1 if lag.seconds is None else lag.seconds)


def lag_groups(kafka: KafkaSettings, settings: WorkerSettings) -> list[GroupTopics]:
    """The worker's groups, one per request topic: consumer groups (partition intake) or share groups."""
    from inference.worker.intake import request_topics
    from inference.worker.intake_partition import partition_group_ids
    from inference.worker.intake_share import share_group_ids

    share = settings.intake == "share"
    ids = share_group_ids(settings) if share else partition_group_ids(settings)
    return [GroupTopics(ids[priority], (topic,), "share" if share else "consumer")
            for topic, priority in request_topics(kafka).items()]


def serve_with_readiness(port: int, addr: str, metrics_app: Any, ready: Callable[[], tuple[bool, str]]) -> None:
    """prometheus_client's WSGI app with ``/ready`` beside it, on a thread of its own (as start_http_server)."""
    import threading
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client.exposition import ThreadingWSGIServer

    def app(environ: dict, start_response: Callable) -> Any:
        if environ.get("PATH_INFO") == "/ready":
            ok, text = ready()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [text.encode() + b"\n"]
        return metrics_app(environ, start_response)

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: not worth a log line
            pass

    server = make_server(addr, port, app, ThreadingWSGIServer, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, name="chatpipe-metrics", daemon=True).start()
