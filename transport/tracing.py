"""W3C Trace Context (``traceparent``) in Kafka headers.

Every chatpipe hop reads the ``traceparent`` header of the message it consumed and writes a
child of it on what it produces, so one trace id follows a prompt from the gateway to the turn
archive. Only the header format lives here (version-traceid-spanid-flags, W3C Trace Context
level 1); spans and exporters belong to OpenTelemetry, whose Kafka instrumentations read and
write the same header. Hand-written because producing a child id needs no tracer SDK on the
hot path: a few string functions, no state.

Ids come from ``random.getrandbits``, not ``secrets``: they must be unique, not secret, and
``os.urandom`` twice per message was a third of the producer adapter's per-message cost
(2.2 us of 6.5 us in ``bench/kafka_io.py``). ``random`` reseeds itself in forked children.
"""

from __future__ import annotations

import random
import re

HEADER = "traceparent"
_FORMAT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")

Headers = list[tuple[str, bytes | None]]


_bits = random.getrandbits


def _span_id() -> str:
    return f"{_bits(64) or 1:016x}"  # all-zero ids are invalid in W3C Trace Context


def new_traceparent(sampled: bool = True) -> str:
    """A root traceparent: fresh trace id and span id."""
    return f"00-{_bits(128) or 1:032x}-{_span_id()}-{'01' if sampled else '00'}"


def child_traceparent(parent: str | None) -> str:
    """Same trace as ``parent`` with a new span id; a new root if ``parent`` is missing or invalid."""
    if parent:
        match = _FORMAT.match(parent)
        if match and match[1] != "0" * 32:
            return f"00-{match[1]}-{_span_id()}-{match[3]}"
    return new_traceparent()


def trace_id(traceparent: str | None) -> str | None:
    match = _FORMAT.match(traceparent or "")
    return match[1] if match else None


def find(headers: Headers | None) -> str | None:
    """The traceparent value in Kafka headers, if any."""
    for key, value in headers or ():
        if key == HEADER and value is not None:
            try:
                return value.decode("ascii")
            except UnicodeDecodeError:
                return None
    return None


def with_traceparent(headers: Headers | None, parent: str | None = None) -> Headers:
    """``headers`` with a traceparent: kept if already there, else a child of ``parent``."""
    if not headers:  # the common case on the produce hot path
        return [(HEADER, (child_traceparent(parent) if parent else new_traceparent()).encode("ascii"))]
    headers = list(headers)
    if find(headers) is None:
        headers.append((HEADER, child_traceparent(parent).encode("ascii")))
    return headers
