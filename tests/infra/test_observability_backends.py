"""The real observability backends, built as ``chatpipe up --observability`` builds them (once per machine,
cached in ~/.cache/chatpipe/bin: `make test-prerequisites` builds them first, ~25 min the first time): Jaeger
takes an OTLP/HTTP span from OpenTelemetry's own exporter and gives it back through its query API;
Prometheus, run on the generated config, scrapes a service's /metrics; and both run as services of the
stack, under its supervisor, shown by ``status`` and stopped by ``down``."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from chatpipe.testing.ports import free_port as _free_port
from infra.observability import backends, binaries
from infra.settings import StackSettings

pytestmark = pytest.mark.integration

_no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str) -> tuple[int, bytes]:
    try:
        with _no_proxy.open(url, timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _until(check, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.3)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


@pytest.fixture(scope="module")
def installed():
    """Both programs (and the UIs this machine could build), as `make test`'s `test-prerequisites` step
    built them before pytest started (a first build takes ~25 min: it says so there, line by line,
    where pytest -q would show nothing). Missing: fails naming the command; never skipped, never built here."""
    try:
        return binaries.installed(StackSettings())
    except binaries.BuildError as exc:
        pytest.fail(f"{exc}\nbuild them before the tests: make test-prerequisites "
                    "(or .venv/bin/python -m infra.observability.binaries)", pytrace=False)


@pytest.fixture
def settings(tmp_path):
    return StackSettings(state_dir=tmp_path, otlp_grpc_port=_free_port(), otlp_http_port=_free_port(),
                         jaeger_port=_free_port(), jaeger_grpc_port=_free_port(), prometheus_port=_free_port(),
                         gateway_port=_free_port(), worker_metrics_port=_free_port(), scrape_interval_s=1)


@pytest.fixture
def run(tmp_path):
    """``run(settings, name, installed)``: the backend as the stack's supervisor would start it; stopped after."""
    procs = []

    def start(settings, name, installed):
        backends.write_config(settings, name, installed)
        argv, cwd = backends.command(settings, name, installed)
        cwd.mkdir(parents=True, exist_ok=True)
        log = open(tmp_path / f"{name}.log", "ab")
        procs.append(proc := subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT))
        _until(lambda: proc.poll() is not None or not backends.not_ready(settings, name), f"{name} ready")
        assert proc.poll() is None, f"{name} exited: {(tmp_path / f'{name}.log').read_text()[-3000:]}"
        return proc

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)


def test_jaeger_keeps_an_otlp_span_and_gives_it_back_by_trace_id(settings, installed, run):
    """An OTLP/HTTP receiver as any OpenTelemetry SDK uses it: the span sent by OpenTelemetry's own
    (protobuf) exporter must come back from Jaeger's query API (v1 and v3) with its service and
    name; the UI page is the real Jaeger UI when its assets were built, else Jaeger's placeholder."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    run(settings, backends.JAEGER, installed)
    provider = TracerProvider(resource=Resource.create({"service.name": "chatpipe-test"}))
    provider.add_span_processor(SimpleSpanProcessor(
        OTLPSpanExporter(endpoint=f"{backends.otlp_endpoint(settings)}/v1/traces")))
    with provider.get_tracer("tests").start_as_current_span("gateway.request") as span:
        span.set_attribute("chatpipe.request_id", "r-1")
        trace_id = f"{span.get_span_context().trace_id:032x}"
    provider.shutdown()
    query = f"http://127.0.0.1:{settings.jaeger_port}"

    def found():
        code, body = _get(f"{query}/api/traces/{trace_id}")
        return json.loads(body)["data"] if code == 200 else None

    (trace,) = _until(found, f"trace {trace_id} in Jaeger")
    (kept,) = trace["spans"]
    assert kept["operationName"] == "gateway.request" and kept["traceID"] == trace_id
    assert trace["processes"][kept["processID"]]["serviceName"] == "chatpipe-test"
    assert {"key": "chatpipe.request_id", "type": "string", "value": "r-1"} in kept["tags"]
    code, body = _get(f"{query}/api/v3/traces/{trace_id}")  # OTLP JSON, as sent
    assert code == 200 and b"gateway.request" in body
    code, page = _get(f"{query}/")
    assert code == 200
    if installed.jaeger_ui is not None:
        assert b"jaeger-ui-root" in page and b"placeholder" not in page
        code, _ = _get(f"{query}/search")  # the UI's own routes are served its index.html too
        assert code == 200
    else:
        assert b"This is a placeholder for the Jaeger UI home page" in page


def test_chatpipes_own_spans_reach_jaeger_and_chatpipe_trace_reads_them_back(settings, installed, run):
    """What the services send (transport/spans.py: OTLP/JSON over HTTP, not the SDK's protobuf) is
    taken by the real Jaeger, parents and links kept; `chatpipe trace --jaeger` finds the request by
    its id and prints its hops."""
    from transport import spans, tracing

    run(settings, backends.JAEGER, installed)
    spans.shutdown()
    spans.configure("test", spans.TracingSettings(otlp_endpoint=backends.otlp_endpoint(settings),
                                                  export_interval_s=60))
    request_id = f"r-{time.time_ns()}"
    try:
        gateway, streams = spans.Tracer("gateway"), spans.Tracer("streams")
        http = gateway.start("POST /v1/chat/completions", None, spans.SERVER, {"chatpipe.request_id": request_id})
        sent = tracing.child_traceparent(http.traceparent)
        gateway.record_send("chat.prompts", sent, http.traceparent, time.time_ns())
        intake = streams.process("chat.prompts", sent, partition=0, offset=1,
                                 attributes={"chatpipe.request_id": request_id})
        intake.child("embed", attributes={"chatpipe.batch.size": 2}).end()
        intake.end()
        http.end()
        spans.flush()
    finally:
        spans.shutdown()
    query = f"http://127.0.0.1:{settings.jaeger_port}"

    def found():
        code, body = _get(f"{query}/api/traces/{http.trace_id}")
        data = json.loads(body)["data"] if code == 200 else None
        return data if data and len(data[0]["spans"]) == 4 else None

    (trace,) = _until(found, f"the 4 spans of trace {http.trace_id} in Jaeger")
    by_name = {s["operationName"]: s for s in trace["spans"]}
    parent_of = {name: next((r["spanID"] for r in s["references"] if r["refType"] == "CHILD_OF"), None)
                 for name, s in by_name.items()}
    assert parent_of["send chat.prompts"] == http.span_id
    assert parent_of["process chat.prompts"] == sent[36:52]
    assert parent_of["embed"] == intake.span_id
    services = {trace["processes"][s["processID"]]["serviceName"] for s in trace["spans"]}
    assert services == {"gateway", "streams"}
    from chatpipe.testing.worker import CHATPIPE

    shown = subprocess.run([str(CHATPIPE), "trace", request_id, "--jaeger", query, "--json"], capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    listed = [json.loads(line) for line in shown.stdout.splitlines()]
    assert {x["name"] for x in listed} == set(by_name)
    assert {x["span_id"]: x["parent_id"] for x in listed}[intake.span_id] == sent[36:52]


def test_prometheus_on_the_generated_config_scrapes_a_service(settings, installed, run):
    """A service's /metrics (here a prometheus_client server on the gateway's port) must be a target that
    is up, and its samples queryable, through Prometheus's HTTP API; the pages are Prometheus's UI when it
    was built (npm), else the API alone answers."""
    from prometheus_client import CollectorRegistry, Counter, start_http_server

    registry = CollectorRegistry()
    Counter("chatpipe:generation_tokens", "Tokens generated", registry=registry).inc(7)
    server, thread = start_http_server(settings.gateway_port, addr="127.0.0.1", registry=registry)
    try:
        run(settings, backends.PROMETHEUS, installed)
        api = f"http://127.0.0.1:{settings.prometheus_port}/api/v1"

        def gateway_target():
            targets = json.loads(_get(f"{api}/targets")[1])["data"]["activeTargets"]
            return next((t for t in targets if t["labels"]["job"] == "gateway" and t["health"] == "up"), None)

        target = _until(gateway_target, "the gateway target up")
        assert target["labels"]["service"] == "gateway"
        assert target["scrapeUrl"] == f"http://127.0.0.1:{settings.gateway_port}/metrics"

        def tokens():
            result = json.loads(_get(f"{api}/query?query=chatpipe:generation_tokens_total")[1])["data"]["result"]
            return result[0]["value"][1] if result else None

        assert _until(tokens, "the scraped counter") == "7"
        code, page = _get(f"http://127.0.0.1:{settings.prometheus_port}/query")
        if installed.prometheus_ui is not None:
            assert code == 200 and b"<title>Prometheus" in page
        else:
            assert code == 500 and b"index.html" in page
    finally:
        server.shutdown()
        thread.join(timeout=5)


def test_up_runs_both_under_the_supervisor_status_shows_them_and_down_stops_them(settings, installed):
    """`up --observability --only kafka,jaeger,prometheus` must start both backends as services of the
    stack (supervised, healthy in `status`, with their addresses), and `down` must stop them."""
    from infra.stack import LocalStack

    settings = settings.model_copy(update={"observability": True, "kafka_port": _free_port(),
                                           "controller_port": _free_port()})
    stack = LocalStack(settings)
    try:
        stack.up(["kafka", "jaeger", "prometheus"])
        health = {h.name: h for h in LocalStack.open(settings).status()}
        for name in ("jaeger", "prometheus"):
            assert health[name].healthy and health[name].supervised, health[name]
        assert f"http://127.0.0.1:{settings.jaeger_port}" in health["jaeger"].address
        assert f":{settings.otlp_http_port} HTTP" in health["jaeger"].address
        assert health["prometheus"].address.startswith(f"http://127.0.0.1:{settings.prometheus_port} (")
        assert health["streams"].state == "not started"
    finally:
        results = {r.name: r for r in LocalStack.open(settings).down()}
    assert results["jaeger"].outcome == "stopped" and results["prometheus"].outcome == "stopped"
    for port in (settings.jaeger_port, settings.prometheus_port, settings.otlp_http_port):
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still taken after down"
