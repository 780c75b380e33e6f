"""Prometheus metrics of one gateway (``GET /metrics``), on a registry of its own.

Requests are counted by outcome (``ok``, ``rejected_busy``, ``expired``, ``cancelled``, ...: how each
ended, whatever HTTP status carried it). The latency histograms use vLLM's buckets (TTFT up to
2560 s, request duration up to 7680 s, as ``inference/worker/metrics.py``): a request of minutes
(a backlog, a long answer on a CPU) lands in a bucket, not in +Inf.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
         160.0, 640.0, 2560.0)
_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
            1920.0, 7680.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("chatpipe_gateway_requests", "Chat completion requests by outcome", ["outcome"],
                                registry=r)
        self.pending = Gauge("chatpipe_gateway_pending", "Requests in flight (produced, answer not complete)",
                             registry=r)
        self.ttft = Histogram("chatpipe_gateway_ttft_seconds", "Request received -> first token", buckets=_TTFT,
                              registry=r)
        self.duration = Histogram("chatpipe_gateway_request_seconds", "Request received -> last token",
                                  buckets=_REQUEST, registry=r)
        self.tokens = Counter("chatpipe_gateway_completion_tokens", "Tokens streamed to clients", registry=r)
        self.files = Counter("chatpipe_gateway_file_operations", "Files API calls (gateway/files.py) by outcome",
                             ["operation", "outcome"], registry=r)
        self.file_bytes = Counter("chatpipe_gateway_file_upload_bytes", "Bytes of files uploaded", registry=r)
        self.batch_lines = Counter("chatpipe_gateway_batch_lines", "Batch lines answered and stored by this "
                                   "gateway's runner (gateway/batch_runner.py), by outcome (ok, error)", ["outcome"],
                                   registry=r)
        self.cancels = Counter("chatpipe_gateway_cancels", "Cancels sent (client went away or timed out)",
                               registry=r)
