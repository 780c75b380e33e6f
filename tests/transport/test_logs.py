"""transport/logs.py: JSON log lines carry the current span's trace, span and request ids."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from transport import spans
from transport.logs import JsonFormatter, faust_logging_config, log_format

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def record(message: str, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            exc_info = sys.exc_info()
    return logging.LogRecord("chatpipe.test", logging.WARNING, __file__, 1, message, (), exc_info)


def test_a_line_logged_inside_a_span_carries_its_ids():
    span = spans.Tracer("svc").start("process", attributes={"chatpipe.request_id": "req-9"}).activate()
    try:
        line = json.loads(JsonFormatter("inference").format(record("taken %s")))
    finally:
        spans.deactivate()
    assert line["trace_id"] == span.trace_id and line["span_id"] == span.span_id
    assert line["request_id"] == "req-9"
    assert line["service"] == "inference" and line["level"] == "WARNING" and line["logger"] == "chatpipe.test"
    assert line["message"] == "taken %s" and line["ts"].endswith("Z") and line["pid"] == os.getpid()


def test_outside_a_span_the_ids_are_null_and_a_traceback_is_kept():
    line = json.loads(JsonFormatter("gateway").format(record("failed", exc=True)))
    assert line["trace_id"] is None and line["request_id"] is None
    assert "RuntimeError: boom" in line["exception"]


def test_the_format_is_checked(monkeypatch):
    monkeypatch.setenv("CHATPIPE_LOG_FORMAT", "JSON")
    assert log_format() == "json" and faust_logging_config("streams", "info")["root"]["level"] == "INFO"
    monkeypatch.setenv("CHATPIPE_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="expected one of text, json"):
        log_format()
    monkeypatch.delenv("CHATPIPE_LOG_FORMAT")
    assert log_format() == "text" and faust_logging_config("streams", "info") is None


def test_a_service_started_with_json_logs_writes_json_lines(tmp_path):
    """The gateway process itself, pointed at a broker that is not there: its lines, up to its exit,
    are JSON objects with the same fields."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-x": "acme"}))
    env = {**os.environ, "CHATPIPE_LOG_FORMAT": "json", "CHATPIPE_BOOTSTRAP_SERVERS": "127.0.0.1:1",
           "CHATPIPE_GATEWAY_KEYS_FILE": str(keys), "CHATPIPE_GATEWAY_PORT": str(port),
           "CHATPIPE_GATEWAY_DELIVERY_TIMEOUT_S": "2"}
    done = subprocess.run([sys.executable, "-m", "chatpipe.cli", "gateway"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    lines = [json.loads(x) for x in (done.stdout + done.stderr).splitlines() if x.startswith("{")]
    assert lines, f"no JSON line:\n{done.stdout}\n{done.stderr}"
    assert all({"ts", "level", "service", "logger", "message", "trace_id", "request_id"} <= set(x) for x in lines)
    assert {x["service"] for x in lines} == {"gateway"}
