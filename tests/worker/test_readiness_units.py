"""The worker's /ready (a pod's readiness) beside /metrics on one port: 503 with the reason until it holds
every version it must, then 200 (inference/worker/metrics.py ``serve_with_readiness``)."""

from __future__ import annotations

import httpx

from chatpipe.testing.ports import free_port
from inference.worker.metrics import WorkerMetrics


def test_ready_says_why_not_until_the_versions_are_held_and_metrics_stay_served():
    state = {"pending": ["acme-lora@2"]}
    ready = lambda: (False, f"loading model versions: {', '.join(state['pending'])}") if state["pending"] else (
        True, "serving")
    port = free_port()
    WorkerMetrics("m").serve(port, ready=ready)
    not_yet = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=10)
    assert (not_yet.status_code, not_yet.text) == (503, "loading model versions: acme-lora@2\n")
    state["pending"] = []
    assert httpx.get(f"http://127.0.0.1:{port}/ready", timeout=10).status_code == 200
    assert "chatpipe_" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
