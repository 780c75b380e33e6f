"""Prometheus metrics of one worker (prometheus-client), in a registry of its own so that several
workers in one process (tests) do not collide. ``serve(port)`` exposes ``/metrics``; port 0 = off."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1)
STATES = ("STARTING", "SERVING", "DRAINING", "STOPPED", "FAILED")


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.queue_time = Histogram("chatpipe_worker_queue_seconds", "Enqueued on Kafka -> admitted by the engine",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("chatpipe_worker_ttft_seconds", "Enqueued on Kafka -> first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("chatpipe_worker_tpot_seconds", "Mean time per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.tokens_per_s = Gauge("chatpipe_worker_tokens_per_second", "Generated tokens/s (engine, last seconds)",
                                  registry=r)
        self.batch_size = Gauge("chatpipe_worker_batch_size", "Requests running in the engine", registry=r)
        self.in_flight = Gauge("chatpipe_worker_in_flight", "Requests taken and not yet answered", registry=r)
        self.consumer_lag = Gauge("chatpipe_worker_consumer_lag", "Records behind on assigned partitions "
                                  "(-1: not known, share intake)", registry=r)
        self.requests = Counter("chatpipe_worker_requests", "Requests by outcome", ["outcome"], registry=r)
        self.tokens = Counter("chatpipe_worker_generated_tokens", "Output tokens streamed", registry=r)
        # A scraper must not read "serving" from a worker that has stopped consuming: FAILED from the
        # moment a thread it needs dies until the process exits.
        self.state = Enum("chatpipe_worker_state", "Worker state", states=list(STATES), registry=r)

    def serve(self, port: int) -> None:
        if port:
            start_http_server(port, addr="127.0.0.1", registry=self.registry)
