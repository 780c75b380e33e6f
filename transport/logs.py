"""Service logs: plain text for a person at a terminal, or JSON lines with the same fields in every service.

``CHATPIPE_LOG_FORMAT=json`` makes the gateway, the streams worker and the inference worker log one
JSON object per line: ``ts`` (UTC, ISO-8601, ms), ``level``, ``service``, ``pid``, ``logger``,
``message``, ``trace_id``, ``span_id`` and ``request_id`` of the span the line was logged in (null
outside one), ``exception`` (the traceback) when there is one. A log line and the trace of the
request it is about then meet on ``trace_id`` (docs/observability.md "Logs"). Default ``text``: the
format the services always had.

The span comes from ``transport.spans.current_span()``, set by the hop that processes a record
(the worker per request, the gateway per HTTP request, streams per prompt and per response).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from transport import spans
from transport.log_settings import FORMATS, LogSettings  # noqa: F401 - FORMATS: re-exported

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_format() -> str:
    """``CHATPIPE_LOG_FORMAT`` (LogSettings): text or json; another value is a ValueError naming both."""
    from pydantic import ValidationError

    try:
        return LogSettings().format
    except ValidationError as exc:
        raise ValueError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None


class JsonFormatter(logging.Formatter):
    """One JSON object per record, with the current span's ids."""

    def __init__(self, service: str = "chatpipe") -> None:
        super().__init__()
        self.service = service
        self.pid = os.getpid()

    def format(self, record: logging.LogRecord) -> str:
        span = spans.current_span()
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "service": self.service, "pid": self.pid, "logger": record.name,
            "message": record.getMessage(),
            "trace_id": span.trace_id if span is not None else None,
            "span_id": span.span_id if span is not None else None,
            "request_id": (span.attributes or {}).get("chatpipe.request_id") if span is not None else None,
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            line["exception"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(service: str, level: str | int) -> None:
    """The root logger of a service process, in the ``CHATPIPE_LOG_FORMAT`` format."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(service) if log_format() == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if isinstance(level, str) else level)


def faust_logging_config(service: str, level: str) -> dict[str, Any] | None:
    """Faust's worker sets logging up itself (mode's ``setup_logging``): the dictConfig that gives it
    the JSON formatter, or None for its own text format."""
    if log_format() != "json":
        return None
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"json": {"()": JsonFormatter, "service": service}},
            "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stdout"}},
            "root": {"level": level.upper(), "handlers": ["out"]}}
