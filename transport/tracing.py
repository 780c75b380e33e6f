"""W3C Trace Context (``traceparent``) in Kafka headers.

Every chatpipe hop reads the ``traceparent`` header of the message it consumed and writes a
child of it on what it produces, so one trace id follows a prompt from the gateway to the turn
archive. Only the header format lives here (version-traceid-spanid-flags, W3C Trace Context
level 1); spans and exporters belong to OpenTelemetry, whose Kafka instrumentations read and
write the same header. Hand-written because producing a child id needs no tracer SDK on the
hot path: a few string functions, no state.

Ids come from ``random.getrandbits``, not ``secrets``: they must be unique, not secret, and
``os.urandom`` twice per message was a third of the producer adapter's per-message cost
(2.2 us of 6.5 us in ``bench/kafka_io.py``). ``random`` reseeds itself in forked children. A new
traceparent takes one ``getrandbits(192)`` for both ids, hexed by ``bytes.hex``: 0.32-0.39 us a
record produced, where two calls formatted with ``:032x``/``:016x`` took 0.62-0.73 us (timeit best
of 7, alternated, on the shared 2-core EPYC VM); a child, 0.69-0.77 us instead of 0.89-0.91 (the
regex is most of what is left).
"""

from __future__ import annotations

import random
import re

HEADER = "traceparent"
_FORMAT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")

Headers = list[tuple[str, bytes | None]]


_bits = random.getrandbits
_to_bytes = int.to_bytes
_ZERO_SPAN = "0" * 16
_ZERO_TRACE = "0" * 32


def _span_id() -> str:
    span = _to_bytes(_bits(64), 8, "little").hex()
    while span == _ZERO_SPAN:
        span = _to_bytes(_bits(64), 8, "little").hex()
    return span


def new_traceparent(sampled: bool = True) -> str:
    """A root traceparent: fresh trace id and span id (the first 32 and last 16 of 48 random hex
    digits), neither all zero (invalid in W3C Trace Context)."""
    ids = _to_bytes(_bits(192), 24, "little").hex()
    while _ZERO_SPAN in ids and (ids.startswith(_ZERO_TRACE) or ids.endswith(_ZERO_SPAN)):  # 5e-20 a call
        ids = _to_bytes(_bits(192), 24, "little").hex()
    return f"00-{ids[:32]}-{ids[32:]}-01" if sampled else f"00-{ids[:32]}-{ids[32:]}-00"


def child_traceparent(parent: str | None) -> str:
    """Same trace as ``parent`` with a new span id; a new root if ``parent`` is missing or invalid."""
    if parent and len(parent) == 55 and _FORMAT.match(parent) and parent[3:35] != _ZERO_TRACE:
        return f"{parent[:36]}{_span_id()}{parent[52:]}"
    return new_traceparent()


def trace_id(traceparent: str | None) -> str | None:
    match = _FORMAT.match(traceparent or "")
    return match[1] if match and len(traceparent) == 55 else None


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
