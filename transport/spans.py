"""Spans: what each hop of a request did and for how long, exported as OpenTelemetry (OTLP) traces.

Every service records its spans here: the gateway's request, every Kafka produce ("send") and
consume ("receive" of a batch, "process" of one record), streams intake's embed/recall/assemble,
the worker's queue wait/prefill/decode. Context travels in the W3C ``traceparent`` header that
``transport.tracing`` already writes on every record: a record's traceparent *is* the context of
the span that produced it, so the span that processes it on the next hop is its child, and one
trace id follows a request from the HTTP call to the training row (docs/observability.md).

Why not the OpenTelemetry SDK's ``Tracer``: one SDK span costs about 15 us of Python (measured,
``start_span`` + ``end`` with a BatchSpanProcessor), two to three times what the producer adapter
spends on a whole record (``bench/kafka_io.py``). A span here is a tuple appended to a deque, a
record's send span seven fields appended to another (0.2 us on the producer's hot path); a
background thread turns them into OTLP/JSON (the OpenTelemetry protocol's own JSON encoding: hex
ids, nanosecond strings), by hand (a send span ~0.5 us, where json.dumps of the OTLP dicts took
13 us), and writes them to
``<file_dir>/<service>-<pid>.jsonl`` and/or posts them to an OTLP/HTTP receiver
(``<otlp_endpoint>/v1/traces``: Jaeger, an OpenTelemetry Collector). Span names, kinds and
attributes follow OpenTelemetry's semantic conventions (``messaging.*``, ``gen_ai.*``, ``http.*``),
so any OTLP backend reads them as it reads the SDK's.

Nothing is recorded until :func:`configure` is called with somewhere to send spans; the ids are
made and propagated either way. A trace not sampled (traceparent flags ``00``) records nothing.
If spans come faster than they can be exported, the oldest are dropped and counted
(``dropped``), never the service's own work.
"""

from __future__ import annotations

import atexit
import contextvars
import json
import logging
import math
import os
import random
import threading
import time
import urllib.request
from collections import deque
from itertools import islice, repeat
from operator import getitem, itemgetter
from pathlib import Path
from typing import Any, Iterable

from confluent_kafka import Message
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from transport import tracing
from transport.batches import pause_gc, resume_gc

log = logging.getLogger(__name__)

# OTLP span kinds (opentelemetry.proto.trace.v1.Span.SpanKind)
INTERNAL, SERVER, CLIENT, PRODUCER, CONSUMER = 1, 2, 3, 4, 5
_STATUS_ERROR = 2

_time_ns = time.time_ns


class TracingSettings(BaseSettings):
    """Where spans go. The local stack sets ``CHATPIPE_TRACING_FILE_DIR`` to ``<state>/traces`` for
    every service it starts, and ``CHATPIPE_TRACING_OTLP_ENDPOINT`` when ``up --observability``
    runs a trace store."""

    model_config = SettingsConfigDict(env_prefix="CHATPIPE_TRACING_", frozen=True, extra="forbid")

    enabled: bool = Field(True, description="Record spans (ids are propagated either way)")
    file_dir: Path | None = Field(None, description="Write OTLP/JSON lines to <file_dir>/<service>-<pid>.jsonl")
    otlp_endpoint: str | None = Field(None, description="POST OTLP/JSON to <endpoint>/v1/traces, e.g. "
                                      "http://127.0.0.1:4318 (Jaeger, an OpenTelemetry Collector)")
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0, description="Share of new traces recorded (a trace "
                                "started elsewhere keeps its own sampled flag)")
    capture_content: bool = Field(False, description="Put prompt and answer text on spans (off: privacy)")
    export_interval_s: float = Field(0.5, gt=0, description="How often recorded spans are exported")
    max_queued: int = Field(100_000, ge=100, description="Spans held for export, and as many records' send "
                            "spans; beyond, the oldest are dropped")
    file_max_bytes: int = Field(64 << 20, ge=1 << 16, description="A span file past this size is rotated "
                                "to <name>.1 (one old file kept)")
    max_links: int = Field(32, ge=1, description="Links of a batch's receive span: to at most this many of its "
                           "records, evenly spread, the rest counted as droppedLinksCount (OpenTelemetry's SDK "
                           "keeps 128 a span); each record's own process span is a child of its producer span either way")

    @property
    def exporting(self) -> bool:
        return self.enabled and (self.file_dir is not None or bool(self.otlp_endpoint))


# A recorded span, one of two kinds. Nothing is parsed or built on the hot path: ids are cut from
# the traceparent strings, attributes built and everything encoded on the export thread.
#   a span (``Span.end``, receives): a tuple (service, traceparent, parent span id or None, name,
#     kind, start ns, end ns, attributes or None, links or None, error message or None), in
#     ``SpanRecorder._queue``. Links: traceparents, or ``_MessageLinks`` (a consumed batch's).
#   a send (``Tracer.record_send``, one per record produced): seven fields (service, traceparent,
#     the parent's traceparent or None, topic, partition or None, start ns, end ns) appended flat
#     to ``SpanRecorder._sends``, no tuple kept: a tuple a record held until the export is one GC
#     container more a record, a young collection every 700 records sent (86 per 60k in
#     bench/kafka_io.py instead of 12, and now and then a full one: 0.65 us a record). Its name,
#     kind and attributes are fixed, so the export formats it from a template (``_send_templates``);
#     building the attributes dict and the name here cost 0.4 us of the 0.9 us a send took.
_Record = tuple
_SEND_LEN = 7
_NOTHING = object()  # what no queue holds (a send's fields include None)


class Span:
    """One span being timed. ``traceparent`` is its context for children and for the records it
    produces; ``end()`` records it (when a recorder is configured and the trace is sampled)."""

    __slots__ = ("tracer", "traceparent", "parent_id", "name", "kind", "start_ns", "attributes", "links",
                 "error", "ended")

    def __init__(self, tracer: "Tracer", traceparent: str, parent_id: str | None, name: str, kind: int,
                 start_ns: int, attributes: dict[str, Any] | None, links: Any) -> None:
        self.tracer = tracer
        self.traceparent = traceparent
        self.parent_id = parent_id
        self.name = name
        self.kind = kind
        self.start_ns = start_ns
        self.attributes = attributes
        self.links = links
        self.error: str | None = None
        self.ended = False

    @property
    def trace_id(self) -> str:
        return self.traceparent[3:35]

    @property
    def span_id(self) -> str:
        return self.traceparent[36:52]

    @property
    def sampled(self) -> bool:
        return self.traceparent.endswith("01")

    def set(self, key: str, value: Any) -> "Span":
        return self.update({key: value})

    def update(self, attributes: dict[str, Any]) -> "Span":
        if self.attributes is None:
            self.attributes = {}
        self.attributes.update(attributes)
        return self

    def fail(self, error: BaseException | str) -> "Span":
        self.error = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else error
        return self

    def child(self, name: str, kind: int = INTERNAL, attributes: dict[str, Any] | None = None,
              start_ns: int | None = None, links: Any = None) -> "Span":
        return self.tracer.start(name, self.traceparent, kind, attributes, start_ns=start_ns, links=links)

    def end(self, end_ns: int | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        recorder = _recorder
        if recorder is not None and self.traceparent[-1] == "1":
            recorder.add((self.tracer.service, self.traceparent, self.parent_id, self.name, self.kind,
                          self.start_ns, end_ns or _time_ns(), self.attributes, self.links, self.error))

    def activate(self) -> "Span":
        """Make this the current span of the running task (or thread): log lines then carry its ids
        (transport/logs.py)."""
        _current.set(self)
        return self

    def __enter__(self) -> "Span":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and self.error is None:
            self.fail(exc)
        self.end()


_current: contextvars.ContextVar[Span | None] = contextvars.ContextVar("chatpipe_span", default=None)


def current_span() -> Span | None:
    """The span the running task activated last (``Span.activate``), if any."""
    return _current.get()


def deactivate() -> None:
    _current.set(None)


class Tracer:
    """Spans of one service (its ``service.name`` in the trace store)."""

    __slots__ = ("service",)

    def __init__(self, service: str) -> None:
        self.service = service

    def start(self, name: str, parent: str | None = None, kind: int = INTERNAL,
              attributes: dict[str, Any] | None = None, *, start_ns: int | None = None, links: Any = None) -> Span:
        """A span, child of the ``parent`` traceparent (a header's, or another span's), or the root of a
        new trace (sampled by ``sample_ratio``) when there is none or it is not valid."""
        if parent is not None and len(parent) == 55 and tracing.trace_id(parent) is not None:
            traceparent = tracing.child_traceparent(parent)
            parent_id = parent[36:52]
        else:
            traceparent = tracing.new_traceparent(sampled=_sample_ratio >= 1.0 or random.random() < _sample_ratio)
            parent_id = None
        return Span(self, traceparent, parent_id, name, kind, start_ns or _time_ns(), attributes, links)

    def record_send(self, topic: str, traceparent: str, parent: str | None, start_ns: int,
                    partition: int | None = None) -> None:
        """The hot path of a produce: a PRODUCER span whose context is the record's own ``traceparent``
        (made by ``tracing.with_traceparent``), child of ``parent``. No Span object."""
        recorder = _recorder
        if recorder is not None and traceparent[-1] == "1":
            sends = recorder._sends
            if len(sends) == sends.maxlen:  # the extend pushes the oldest send's seven fields out
                recorder.dropped += 1
            # One extend, atomic under the GIL: the export thread pops whole sends (see flush).
            sends += (self.service, traceparent, parent, topic, partition, start_ns, _time_ns())

    def record_receive(self, topic: str, group: str | None, messages: list, start_ns: int) -> None:
        """A batch consume: one CLIENT "receive" span, its own trace, linked to each record's producer
        span (OpenTelemetry's messaging conventions: a batch has no single parent), up to
        ``max_links`` records evenly spread over a larger batch. ``messages`` are confluent-kafka or
        Faust messages; their traceparents are read here, encoded on the export thread.

        Why a bound: reading a record's headers costs about half of what consuming it does
        (bench/kafka_io.py), so links to every record of a bulk batch would cost the consumer more
        than the rest of tracing; a chat batch (a few records a poll) is linked whole."""
        recorder = _recorder
        if recorder is None or not messages:
            return
        attributes = {"messaging.system": "kafka", "messaging.operation.type": "receive",
                      "messaging.destination.name": topic, "messaging.batch.message_count": len(messages)}
        if group:
            attributes["messaging.consumer.group.name"] = group
        traceparent = tracing.new_traceparent(sampled=_sample_ratio >= 1.0 or random.random() < _sample_ratio)
        if traceparent[-1] == "1":
            n = len(messages)
            picked = messages if n <= _max_links else messages[::-(-n // _max_links)]
            recorder.add((self.service, traceparent, None, f"receive {topic}", CLIENT, start_ns, _time_ns(),
                          attributes, _MessageLinks(picked, n - len(picked)), None))

    def process(self, topic: str, traceparent: str | None, *, group: str | None = None,
                partition: int | None = None, offset: int | None = None,
                attributes: dict[str, Any] | None = None, start_ns: int | None = None) -> Span:
        """The CONSUMER span of processing one record: child of the record's producer span."""
        attrs = {"messaging.system": "kafka", "messaging.operation.type": "process",
                 "messaging.destination.name": topic}
        if group:
            attrs["messaging.consumer.group.name"] = group
        if partition is not None:
            attrs["messaging.destination.partition.id"] = str(partition)
        if offset is not None:
            attrs["messaging.kafka.offset"] = offset
        if attributes:
            attrs.update(attributes)
        return self.start(f"process {topic}", traceparent, CONSUMER, attrs, start_ns=start_ns)


_first, _second = itemgetter(0), itemgetter(1)


class _MessageLinks:
    """The traceparents of a consumed batch, read from its messages' headers as it is received.

    Not on the export thread: a batch held until the export kept its messages (and their 1 KB
    values) alive for up to ``export_interval_s``, promoted by the collections in between, and read
    them back from memory gone cold; 0.9 us a message more than reading them here
    (bench/kafka_io.py, consume with spans, collector off)."""

    __slots__ = ("values", "traceparents", "dropped")

    def __init__(self, messages: list, dropped: int = 0) -> None:
        self.dropped = dropped  # records of the batch not linked (Tracer.record_receive)
        # A GC pause: confluent-kafka keeps the header list and tuple it builds on each message,
        # two tracked objects a message, which would start a young collection in the middle of
        # every batch (see transport/batches.py, pause_gc).
        pause_gc()
        try:
            self.values = _header_values(messages)
            self.traceparents = None if self.values is not None else list(_traceparents(messages))
        finally:
            resume_gc()

    def __iter__(self):
        if self.values is None:
            return iter(self.traceparents)
        return (v.decode("ascii", "replace") for v in self.values)


def _header_values(messages: list) -> list[bytes] | None:
    """The traceparent of every message, when each is a confluent-kafka ``Message`` whose first
    header is its traceparent (what every chatpipe producer writes), read without a Python loop:
    ``headers()`` itself (~0.3 us a message: it builds the header list) is most of a link's cost.
    None when some message is otherwise (``_traceparents`` reads them one by one)."""
    try:
        firsts = list(map(_first, map(Message.headers, messages)))  # TypeError: not a Message, or no headers
    except (TypeError, IndexError):
        return None
    if list(map(_first, firsts)).count(tracing.HEADER) != len(firsts):
        return None
    return list(map(_second, firsts))


def _traceparents(messages: list) -> Iterable[str]:
    for m in messages:
        raw = getattr(m, "_msg", m)  # transport.message.ConsumedMessage wraps confluent's Message
        headers = raw.headers() if callable(getattr(raw, "headers", None)) else getattr(raw, "headers", None)
        if isinstance(headers, dict):
            headers = list(headers.items())
        parent = tracing.find(headers)
        if parent:
            yield parent


# -- the recorder: one per process ------------------------------------------------------------------

_recorder: "SpanRecorder | None" = None
_sample_ratio = 1.0
_capture_content = False
_max_links = 32


def capture_content() -> bool:
    """Whether prompt and answer text may go on spans (``CHATPIPE_TRACING_CAPTURE_CONTENT``)."""
    return _capture_content


def recording() -> bool:
    return _recorder is not None


class SpanRecorder:
    """Holds recorded spans and exports them from a thread of its own."""

    def __init__(self, settings: TracingSettings) -> None:
        self.settings = settings
        self._queue: deque[_Record] = deque(maxlen=settings.max_queued)  # spans
        self._sends: deque[Any] = deque(maxlen=settings.max_queued * _SEND_LEN)  # sends, flat
        self.dropped = 0
        self.exported = 0
        self._posting_failed = False
        self._unposted: deque[str] = deque(maxlen=_UNPOSTED_LIMIT)  # bodies the trace store did not take yet
        self._lock = threading.Lock()  # one export at a time (the thread, or flush())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chatpipe-spans", daemon=True)
        self._thread.start()

    def add(self, record: _Record) -> None:
        queue = self._queue
        if len(queue) == queue.maxlen:  # the append pushes the oldest out
            self.dropped += 1
        queue.append(record)

    def _run(self) -> None:
        while not self._stop.wait(self.settings.export_interval_s):
            self.flush()

    def flush(self) -> None:
        with self._lock:
            queue, sends = self._queue, self._sends
            if not queue and not sends:
                return
            # In a GC pause, from the pop to the drop of the records: a young collection started in
            # the middle would find the popped records alive and promote them.
            pause_gc()
            try:
                # Pops what is there now, each in one C call (only this, under the lock, pops; the hot
                # path appends meanwhile): sends come off whole, seven fields at a time.
                records = list(islice(iter(queue.popleft, _NOTHING), len(queue)))
                flat = list(islice(iter(sends.popleft, _NOTHING), len(sends)))
                # One export request (a line of the file, a POST) per EXPORT_CHUNK spans, each written
                # before the next is encoded: one body of a whole busy interval (60,000 sends, 24 MB)
                # was fresh memory for every copy of it (the join, the bytes, the kernel's), 3.5 us a
                # span on this VM against 1.2-1.5 in chunks whose buffers are reused.
                for i in range(0, len(records), EXPORT_CHUNK):
                    self._export(records[i:i + EXPORT_CHUNK], [])
                step = EXPORT_CHUNK * _SEND_LEN
                for i in range(0, len(flat), step):
                    self._export([], flat[i:i + step])
                del records, flat
            finally:
                resume_gc()

    def _export(self, records: list[_Record], flat: list) -> None:
        count = len(records) + len(flat) // _SEND_LEN
        try:
            body = _otlp_json(records, flat)
        except Exception:  # a bad attribute must not stop every later export
            log.exception("could not encode %d span(s); dropped", count)
            self.dropped += count
            return
        self._write(body)
        self._post(body)
        self.exported += count

    def _write(self, body: str) -> None:
        folder = self.settings.file_dir
        if folder is None:
            return
        service = _service_names[0] if _service_names else "chatpipe"  # the process's first service
        path = folder / f"{service}-{os.getpid()}.jsonl"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if path.exists() and path.stat().st_size > self.settings.file_max_bytes:
                path.replace(path.with_suffix(".jsonl.1"))
            with path.open("ab") as f:  # one encode of the whole body: the text layer's copies cost ~0.5 us a span
                f.write(body.encode("utf-8"))
                f.write(b"\n")
        except OSError as exc:
            log.warning("could not write spans to %s: %s", path, exc)

    def _post(self, body: str) -> None:
        """POST ``body``, and first the bodies an earlier export could not post (the trace store was
        busy or restarting): up to ``_UNPOSTED_LIMIT`` bodies wait, beyond, the oldest are given up
        (the span file, if any, keeps every span)."""
        endpoint = self.settings.otlp_endpoint
        if not endpoint:
            return
        self._unposted.append(body)
        while self._unposted:
            request = urllib.request.Request(endpoint.rstrip("/") + "/v1/traces",
                                             data=self._unposted[0].encode("utf-8"),
                                             headers={"Content-Type": "application/json"}, method="POST")
            try:
                with _direct.open(request, timeout=5.0) as response:
                    response.read()
            except OSError as exc:  # away or busy: tried again at the next export
                if not self._posting_failed:
                    log.warning("could not post spans to %s (%s); retrying at every export, logged once",
                                endpoint, exc)
                    self._posting_failed = True
                return
            self._unposted.popleft()
            if self._posting_failed:
                log.info("spans reach %s again", endpoint)
                self._posting_failed = False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.flush()


EXPORT_CHUNK = 2048  # spans per export request (a line of the span file, a POST to the trace store)
_UNPOSTED_LIMIT = 64  # export bodies kept for a trace store that is away (each at most EXPORT_CHUNK spans)
# The trace store is a local or cluster-internal address: never through an HTTP(S)_PROXY of the environment.
_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))

_service_names: list[str] = []


def configure(service: str, settings: TracingSettings | None = None) -> SpanRecorder | None:
    """Record this process's spans (once per process; later calls only add a service name). Returns
    the recorder, or None when tracing is off or has nowhere to go."""
    global _recorder, _sample_ratio, _capture_content, _max_links
    settings = settings or TracingSettings()
    if service not in _service_names:
        _service_names.append(service)
    if _recorder is not None or not settings.exporting:
        return _recorder
    _sample_ratio = settings.sample_ratio
    _capture_content = settings.capture_content
    _max_links = settings.max_links
    _recorder = SpanRecorder(settings)
    atexit.register(shutdown)
    log.info("spans of %s go to %s", service, ", ".join(
        str(x) for x in (settings.file_dir, settings.otlp_endpoint) if x))
    return _recorder


def shutdown() -> None:
    """Export what is left and stop recording (services call it last on SIGTERM; atexit too)."""
    global _recorder
    recorder, _recorder = _recorder, None
    if recorder is not None:
        recorder.close()


def flush() -> None:
    if _recorder is not None:
        _recorder.flush()


# -- OTLP/JSON ------------------------------------------------------------------------------------------
#
# Written by hand, not through json.dumps of nested dicts: that took 13 us a send span (the dicts
# of attributes and values, then the generic encoder walking them), more than librdkafka's own cost
# of producing the record. A send span is a few pieces around the part made once per topic and
# partition (``_send_templates``), joined with the rest of its export; other spans are joined from pieces, strings escaped by json's own
# C escaper; a batch's links come from its traceparents in a few passes in C. The output is the
# same JSON (tests/transport/test_spans.py parses each path against json.dumps of the OTLP dicts): hex
# ids, nanoseconds and 64-bit ints as strings, typed attribute values.

_str = json.encoder.encode_basestring_ascii  # '"..."', escaped as json.dumps does (C)
_HEX = b"0123456789abcdef"
_IDS = slice(3, 52)  # "<trace id>-<span id>" of a traceparent


def _value_json(v: Any) -> str:
    if v is True:
        return '{"boolValue":true}'
    if v is False:
        return '{"boolValue":false}'
    if isinstance(v, int):
        return '{"intValue":"%d"}' % v  # OTLP/JSON: 64-bit integers as strings
    if isinstance(v, float):
        # proto3 JSON: a double is a number, or "NaN" / "Infinity" / "-Infinity" (not numbers in JSON)
        return '{"doubleValue":%r}' % v if math.isfinite(v) else \
            '{"doubleValue":"%s"}' % ("NaN" if v != v else "Infinity" if v > 0 else "-Infinity")
    if isinstance(v, (list, tuple)):
        return '{"arrayValue":{"values":[%s]}}' % ",".join(map(_value_json, v))
    return '{"stringValue":%s}' % _str(str(v))


def _attributes_json(attributes: dict[str, Any] | None) -> str:
    if not attributes:
        return ""
    return ",".join('{"key":%s,"value":%s}' % (_str(str(k)), _value_json(v))
                    for k, v in attributes.items() if v is not None)


def _links_json(values: list[bytes]) -> str | None:
    """``values`` (traceparents, bytes) as OTLP links, or None unless every one is well formed: then
    no Python runs per link. Each is "00-<32 hex>-<16 hex>-<2 hex>", so "<trace id>-<span id>" has
    its one dash where '","spanId":"' goes."""
    try:
        if set(map(len, values)) != {55}:
            return None
        joined = b"".join(values)
    except TypeError:  # a str, a None
        return None
    n = len(values)
    zeros, dashes = b"0" * n, b"-" * n
    if (joined[0::55] != zeros or joined[1::55] != zeros or joined[2::55] != dashes or joined[35::55] != dashes
            or joined[52::55] != dashes or len(joined.translate(None, _HEX)) != 3 * n):
        return None
    ids = b'"},{"traceId":"'.join(map(getitem, values, repeat(_IDS)))
    return (b'{"traceId":"' + ids.replace(b"-", b'","spanId":"') + b'"}').decode("ascii")


def _links_json_slow(links: Iterable[str]) -> str:
    """One by one: the traceparents that are valid, as OTLP links (the others are left out)."""
    return ",".join('{"traceId":"%s","spanId":"%s"}' % (parent[3:35], parent[36:52])
                    for parent in links if isinstance(parent, str) and tracing.trace_id(parent) is not None)


def _span_json(record: _Record) -> str:
    """A span (the 10-tuple) as OTLP/JSON."""
    service, traceparent, parent_id, name, kind, start, end, attributes, links, error = record
    out = ['{"traceId":', _str(traceparent[3:35]), ',"spanId":', _str(traceparent[36:52])]
    if parent_id:
        out += (',"parentSpanId":', _str(parent_id))
    out += (',"name":', _str(name), ',"kind":%d,"startTimeUnixNano":"%d","endTimeUnixNano":"%d","attributes":['
            % (kind, start, end), _attributes_json(attributes), "]")
    if links:
        encoded = None
        if isinstance(links, _MessageLinks) and links.values is not None:  # a batch consumed: a link a record
            encoded = _links_json(links.values)
        out += (',"links":[', encoded if encoded is not None else _links_json_slow(links), "]")
        if isinstance(links, _MessageLinks) and links.dropped:
            out.append(',"droppedLinksCount":%d' % links.dropped)
    if error:
        out += (',"status":{"code":%d,"message":' % _STATUS_ERROR, _str(error), "}")
    out.append("}")
    return "".join(out)


def _send_span(record: _Record) -> _Record:
    """A send (the 7-tuple) as the span it stands for: what its template encodes."""
    service, traceparent, parent, topic, partition, start, end = record
    attributes = {"messaging.system": "kafka", "messaging.operation.type": "send",
                  "messaging.destination.name": topic}
    if partition is not None:
        attributes["messaging.destination.partition.id"] = str(partition)
    # The parent is the record's parent only if the record continued its trace (an invalid parent
    # made it a new root: tracing.child_traceparent).
    parent_id = parent[36:52] if parent and traceparent.startswith(parent[:35]) else None
    return service, traceparent, parent_id, f"send {topic}", PRODUCER, start, end, attributes, None, None


# (topic, partition) -> what a send span's JSON has between its span id (or parent span id) and its
# start time: its name, kind and attributes, escaped once. The rest are pieces of the export's one
# join (``_append_send_pieces``); a %-format of the whole template parsed its 400 characters on every span (3,300
# instructions of a span's 10,800, callgrind).
_send_templates: dict[tuple[str, Any], str] = {}


def _send_template(topic: str, partition: Any) -> str:
    _, _, _, name, kind, _, _, attributes, _, _ = _send_span(("", "", None, topic, partition, 0, 0))
    middle = '","name":%s,"kind":%d,"attributes":[%s],"startTimeUnixNano":"' % (
        _str(name), kind, _attributes_json(attributes))
    if len(_send_templates) < 10_000:  # a process sends to a few topics; no unbounded growth all the same
        _send_templates[(topic, partition)] = middle
    return middle


def _json_safe(pieces: list[str]) -> bool:
    """Only letters, digits and dashes in ``pieces`` (what goes unescaped into a send span:
    traceparents, which tracing.py makes of hex digits; a caller's own could hold anything). Three
    passes in C, a few instructions a character (``str.isprintable`` took 26)."""
    try:
        return "".join(pieces).encode("ascii").replace(b"-", b"").isalnum()
    except UnicodeEncodeError:
        return False


def _spans_json(records: list[_Record]) -> list[str]:
    """Each span (the 10-tuples) as OTLP/JSON. A record that cannot be encoded is logged and left out."""
    out = []
    for record in records:
        try:
            out.append(_span_json(record))
        except Exception:  # a bad attribute or a malformed record: this span only, not the export
            log.exception("could not encode span %r; left out", record[:4])
    return out


def _append_sends(flat: list, parts: list[str], fast: bool = True) -> None:
    """Each send (seven fields of ``flat``) as OTLP/JSON, comma-separated, appended to ``parts``: in
    pieces around its template (``fast``), or as the span it stands for (``_send_span``), which the
    tests compare."""
    if fast:
        mark = len(parts)
        unescaped = _append_send_pieces(flat, parts)
        if not unescaped or _json_safe(unescaped):
            if len(parts) > mark:
                parts[-1] = '"}'  # no comma after the last send
            return
        del parts[mark:]  # a caller's malformed traceparent: escape everything
    fields = iter(flat)
    encoded = _spans_json([_send_span(send) for send in zip(*(fields,) * _SEND_LEN)])
    if encoded:
        parts.append(",".join(encoded))


def _append_send_pieces(flat: list, parts: list[str]) -> list[str]:
    """The fast path: a send's JSON is eight or ten pieces added to ``parts`` (one join of every
    export's pieces at the end; an f-string per send copied each send's ~400 bytes once more, 0.5 us
    of 1.6 on this VM). Returns the traceparents put in as they are (the caller checks them)."""
    fields = iter(flat)
    extend = parts.extend
    templates = _send_templates
    unescaped: list[str] = []  # the traceparents put into the JSON as they are, checked at the end
    check = unescaped.append
    last_topic = last_partition = middle = None
    for service, traceparent, parent, topic, partition, start, end in zip(*(fields,) * _SEND_LEN):
        try:
            if type(start) is not int:  # a caller's float: str(x) would write its exponent (end is time_ns)
                start = int(start)
            if topic is not last_topic or partition != last_partition:
                middle = templates.get((topic, partition)) or _send_template(topic, partition)
                last_topic, last_partition = topic, partition
            if parent and traceparent.startswith(parent[:35]):  # it continued the parent's trace
                pieces = ('{"traceId":"', traceparent[3:35], '","spanId":"', traceparent[36:52], '","parentSpanId":"',
                          parent[36:52], middle, str(start), '","endTimeUnixNano":"', str(end), '"},')
                check(parent)
            else:
                pieces = ('{"traceId":"', traceparent[3:35], '","spanId":"', traceparent[36:52], middle, str(start),
                          '","endTimeUnixNano":"', str(end), '"},')
        except Exception:  # a malformed record: this span only, not the export
            log.exception("could not encode the send span of %r; left out", (service, traceparent, topic))
            continue
        check(traceparent)
        extend(pieces)
    return unescaped


def _otlp_json(records: list[_Record], flat: list, fast: bool = True) -> str:
    """The ``ExportTraceServiceRequest`` of spans ``records`` and sends ``flat`` (see ``_Record``)."""
    services = dict.fromkeys(map(_first, records))
    services.update(dict.fromkeys(flat[0::_SEND_LEN]))
    pid = os.getpid()
    # One join at the end: a %-format with megabytes of spans as an argument grew its buffer in
    # steps, 0.2 us a span of copying.
    parts = ['{"resourceSpans":[']
    for service in services:
        if len(services) == 1:
            mine, my_sends = records, flat
        else:
            mine = [r for r in records if r[0] == service]
            fields = iter(flat)
            my_sends = [x for send in zip(*(fields,) * _SEND_LEN) if send[0] == service for x in send]
        resource = _attributes_json({"service.name": service, "service.namespace": "chatpipe", "process.pid": pid})
        parts += ('{"resource":{"attributes":[', resource, ']},"scopeSpans":[{"scope":{"name":"chatpipe"},"spans":[')
        mark = len(parts)
        encoded = _spans_json(mine)
        if encoded:
            parts += (",".join(encoded), ",")
        _append_sends(my_sends, parts, fast)
        if len(parts) > mark and parts[-1] == ",":  # spans and no send (or none that could be encoded)
            parts.pop()
        parts += ("]}]}", ",")
    if services:
        parts.pop()
    parts.append("]}")
    return "".join(parts)
