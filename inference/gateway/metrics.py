"""Prometheus metrics of one gateway (``GET /metrics``), on a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("chatpipe_gateway_requests", "Chat completion requests by outcome", ["outcome"],
                                registry=r)
        self.pending = Gauge("chatpipe_gateway_pending", "Requests in flight (produced, answer not complete)",
                             registry=r)
        self.ttft = Histogram("chatpipe_gateway_ttft_seconds", "Request received -> first token", buckets=_LATENCY,
                              registry=r)
        self.duration = Histogram("chatpipe_gateway_request_seconds", "Request received -> last token",
                                  buckets=_LATENCY, registry=r)
        self.tokens = Counter("chatpipe_gateway_completion_tokens", "Tokens streamed to clients", registry=r)
        self.cancels = Counter("chatpipe_gateway_cancels", "Cancels sent (client went away or timed out)",
                               registry=r)
