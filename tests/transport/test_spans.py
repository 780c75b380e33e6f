"""transport/spans.py: spans recorded as tuples (sends as seven flat fields), exported as OTLP/JSON (by\nhand, checked against json.dumps of the OTLP dicts), read back by clients/traces.py."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from confluent_kafka import Message

from clients.traces import read_span_files, spans_of_export, trace_of_request, tree_order
from transport import spans, tracing


def otlp_json(records: list, *, fast: bool = True) -> str:
    """The OTLP/JSON export of ``records`` (spans, and sends as 7-tuples), one resource per service;
    ``fast`` False: sends through the generic span encoder (the tests compare the two)."""
    flat = [x for r in records if len(r) == spans._SEND_LEN for x in r]
    return spans._otlp_json([r for r in records if len(r) != spans._SEND_LEN], flat, fast)


@pytest.fixture
def recorder(tmp_path):
    spans.shutdown()
    rec = spans.configure("unit", spans.TracingSettings(file_dir=tmp_path, export_interval_s=60))
    yield rec
    spans.shutdown()


def test_children_carry_the_trace_and_their_parent(recorder, tmp_path):
    tracer = spans.Tracer("svc")
    incoming = tracing.new_traceparent()
    root = tracer.process("chat.prompts", incoming, partition=3, offset=7,
                          attributes={"chatpipe.request_id": "r1"})
    child = root.child("embed", attributes={"chatpipe.batch.size": 4})
    child.end()
    sent = tracing.child_traceparent(root.traceparent)
    tracer.record_send("chat.inference.requests", sent, root.traceparent, child.start_ns, partition=1)
    root.end()
    spans.flush()

    rows = read_span_files(tmp_path)
    by_name = {r.name: r for r in rows}
    assert set(by_name) == {"process chat.prompts", "embed", "send chat.inference.requests"}
    process, embed, send = by_name["process chat.prompts"], by_name["embed"], by_name["send chat.inference.requests"]
    assert {r.trace_id for r in rows} == {tracing.trace_id(incoming)}
    assert process.parent_id == incoming[36:52]
    assert embed.parent_id == process.span_id and send.parent_id == process.span_id
    assert send.span_id == sent[36:52], "the record's traceparent is its producer span"
    assert process.kind == spans.CONSUMER and send.kind == spans.PRODUCER
    assert process.attributes["messaging.destination.partition.id"] == "3"
    assert process.attributes["messaging.kafka.offset"] == 7
    assert embed.attributes["chatpipe.batch.size"] == 4
    assert {r.service for r in rows} == {"svc"}
    assert [r.name for r in trace_of_request(rows, "r1")][0] == "process chat.prompts"
    assert [r.name for r in tree_order(rows)][0] == "process chat.prompts"


def test_a_trace_not_sampled_records_nothing_but_still_propagates(recorder, tmp_path):
    tracer = spans.Tracer("svc")
    unsampled = tracing.new_traceparent(sampled=False)
    span = tracer.start("work", unsampled)
    assert span.traceparent.endswith("-00") and span.trace_id == tracing.trace_id(unsampled)
    span.end()
    tracer.record_send("t", tracing.child_traceparent(unsampled), unsampled, 0)
    spans.flush()
    assert read_span_files(tmp_path) == []


def test_a_batch_receive_links_to_each_records_producer_span(recorder, tmp_path):
    class Msg:  # what a consumer hands out: confluent's Message has headers() (Faust's: an attribute)
        def __init__(self, tp):
            self._tp = tp

        def headers(self):
            return [("traceparent", self._tp.encode())]

    parents = [tracing.new_traceparent() for _ in range(3)]
    spans.Tracer("svc").record_receive("chat.prompts", "group-a", [Msg(p) for p in parents], 1)
    spans.flush()
    (row,) = read_span_files(tmp_path)
    assert row.kind == spans.CLIENT and row.parent_id is None
    assert row.attributes["messaging.batch.message_count"] == 3
    assert row.attributes["messaging.consumer.group.name"] == "group-a"
    assert row.links == [(p[3:35], p[36:52]) for p in parents]


def test_a_bulk_batch_links_to_at_most_max_links_records_and_counts_the_rest(tmp_path):
    spans.shutdown()
    spans.configure("unit", spans.TracingSettings(file_dir=tmp_path, export_interval_s=60, max_links=8))
    try:
        class Msg:
            def __init__(self, tp):
                self._tp = tp

            def headers(self):
                return [("traceparent", self._tp.encode())]

        small = [tracing.new_traceparent() for _ in range(8)]
        bulk = [tracing.new_traceparent() for _ in range(30)]
        tracer = spans.Tracer("svc")
        tracer.record_receive("small", None, [Msg(p) for p in small], 1)
        tracer.record_receive("bulk", None, [Msg(p) for p in bulk], 2)
        spans.flush()
    finally:
        spans.shutdown()
    rows = {r.name: r for r in read_span_files(tmp_path)}
    assert rows["receive small"].links == [(p[3:35], p[36:52]) for p in small]  # within the bound: every record
    assert rows["receive bulk"].links == [(p[3:35], p[36:52]) for p in bulk[::4]]  # 8 of 30: every 4th, 8 at most
    assert rows["receive bulk"].attributes["messaging.batch.message_count"] == 30
    exported = [json.loads(line) for f in tmp_path.glob("*.jsonl") for line in f.read_text().splitlines()]
    dropped = {s["name"]: s.get("droppedLinksCount", 0) for e in exported for r in e["resourceSpans"]
               for ss in r["scopeSpans"] for s in ss["spans"]}
    assert dropped == {"receive small": 0, "receive bulk": 30 - 8}


def test_errors_become_the_span_status(recorder, tmp_path):
    with pytest.raises(ValueError):
        with spans.Tracer("svc").start("failing"):
            raise ValueError("bad input")
    spans.flush()
    (row,) = read_span_files(tmp_path)
    assert row.error == "ValueError: bad input"


def test_the_export_is_otlp_json_a_receiver_accepts(tmp_path):
    """Posted to <endpoint>/v1/traces as OTLP/JSON: hex ids, nanoseconds as strings, typed values."""
    received: list[tuple[str, dict, str]] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, json.loads(body), self.headers["Content-Type"]))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    spans.shutdown()
    spans.configure("unit", spans.TracingSettings(otlp_endpoint=f"http://127.0.0.1:{server.server_port}",
                                                  export_interval_s=60))
    try:
        span = spans.Tracer("gateway").start("POST /v1/chat/completions", None, spans.SERVER,
                                             {"n": 3, "x": 0.5, "ok": True, "reasons": ["stop"]})
        span.end()
        spans.flush()
    finally:
        spans.shutdown()
        server.shutdown()
    (path, export, content_type), = received
    assert path == "/v1/traces" and content_type == "application/json"
    (resource,) = export["resourceSpans"]
    assert {"key": "service.name", "value": {"stringValue": "gateway"}} in resource["resource"]["attributes"]
    (otlp_span,) = resource["scopeSpans"][0]["spans"]
    assert len(otlp_span["traceId"]) == 32 and len(otlp_span["spanId"]) == 16
    assert otlp_span["kind"] == spans.SERVER and "parentSpanId" not in otlp_span
    assert isinstance(otlp_span["startTimeUnixNano"], str)
    values = {a["key"]: a["value"] for a in otlp_span["attributes"]}
    assert values == {"n": {"intValue": "3"}, "x": {"doubleValue": 0.5}, "ok": {"boolValue": True},
                      "reasons": {"arrayValue": {"values": [{"stringValue": "stop"}]}}}
    (row,) = spans_of_export(export)
    assert row.attributes == {"n": 3, "x": 0.5, "ok": True, "reasons": ["stop"]}


def test_spans_beyond_the_queue_are_dropped_and_counted(tmp_path):
    spans.shutdown()
    rec = spans.configure("unit", spans.TracingSettings(file_dir=tmp_path, export_interval_s=60, max_queued=100))
    try:
        tracer = spans.Tracer("svc")
        for i in range(150):
            tracer.start(f"s{i}").end()
        assert rec.dropped == 50
        spans.flush()
        names = [r.name for r in read_span_files(tmp_path)]
        assert names == [f"s{i}" for i in range(50, 150)], "the oldest are the ones dropped"
    finally:
        spans.shutdown()


def test_nothing_is_recorded_without_somewhere_to_send_spans():
    spans.shutdown()
    assert spans.configure("unit", spans.TracingSettings()) is None
    assert not spans.recording()
    span = spans.Tracer("svc").start("work")
    span.end()  # no recorder: nothing kept, nothing raised
    assert span.traceparent.startswith("00-")


# -- the encoding: fast paths against json.dumps of the OTLP dicts ------------------------------------

def _reference_value(v):
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [_reference_value(x) for x in v]}}
    return {"stringValue": str(v)}


def _reference_attributes(attributes):
    return [{"key": k, "value": _reference_value(v)} for k, v in (attributes or {}).items() if v is not None]


def _reference_export(records):
    """What an exported batch must be: the OTLP dicts, built the plain way (json.dumps of them is
    what transport/spans.py wrote before it encoded by hand). A send (7-tuple) is the PRODUCER span
    "send <topic>" with the messaging attributes, child of its parent if it continued that trace."""
    by_service = {}
    for record in records:
        if len(record) == 7:
            service, tp, parent, topic, partition, start, end = record
            attributes = {"messaging.system": "kafka", "messaging.operation.type": "send",
                          "messaging.destination.name": topic}
            if partition is not None:
                attributes["messaging.destination.partition.id"] = str(partition)
            parent_id = parent[36:52] if parent and parent[3:35] == tp[3:35] else None
            record = (service, tp, parent_id, f"send {topic}", spans.PRODUCER, int(start), end, attributes, None, None)
        service, tp, parent_id, name, kind, start, end, attributes, links, error = record
        span = {"traceId": tp[3:35], "spanId": tp[36:52], "name": name, "kind": kind,
                "startTimeUnixNano": str(start), "endTimeUnixNano": str(end),
                "attributes": _reference_attributes(attributes)}
        if parent_id:
            span["parentSpanId"] = parent_id
        if links:
            span["links"] = [{"traceId": p[3:35], "spanId": p[36:52]} for p in links if tracing.trace_id(p)]
        if error:
            span["status"] = {"code": 2, "message": error}
        by_service.setdefault(service, []).append(span)
    return json.loads(json.dumps({"resourceSpans": [
        {"resource": {"attributes": _reference_attributes({"service.name": s, "service.namespace": "chatpipe",
                                                           "process.pid": os.getpid()})},
         "scopeSpans": [{"scope": {"name": "chatpipe"}, "spans": sp}]} for s, sp in by_service.items()]}))


def _by_span(export):
    """{service: {span id: span}}: the order of spans in an export means nothing."""
    out = {}
    for resource in export["resourceSpans"]:
        service = next(a["value"]["stringValue"] for a in resource["resource"]["attributes"]
                       if a["key"] == "service.name")
        assert service not in out, "one resource per service"
        out[service] = {s["spanId"]: s for scope in resource["scopeSpans"] for s in scope["spans"]}
        assert len(out[service]) == sum(len(scope["spans"]) for scope in resource["scopeSpans"])
        assert resource["resource"]["attributes"][1:] == _reference_attributes(
            {"service.namespace": "chatpipe", "process.pid": os.getpid()})
    return out


def _sample_records():
    parent = tracing.new_traceparent()
    other = tracing.new_traceparent()
    t0 = time.time_ns()
    sends = [
        ("gateway", tracing.new_traceparent(), None, "chat.prompts", None, t0, t0 + 1500),
        ("gateway", tracing.child_traceparent(parent), parent, "chat.prompts", 3, t0 + 1, t0 + 2),
        ("gateway", tracing.child_traceparent(parent), parent, "chat.inference.requests", None, t0 + 2, t0 + 9),
        # the parent is another trace's (a record whose parent was invalid starts its own): no parent id
        ("gateway", tracing.new_traceparent(), other, "chat.prompts", 0, t0 + 3, t0 + 4),
        ("worker", tracing.child_traceparent(parent), parent, 'odd"topic\\é-%s', 11, float(t0 + 5), t0 + 6),
    ]
    others = [
        ("gateway", parent, None, "POST /v1/chat/completions", spans.SERVER, t0, t0 + 10_000,
         {"n": 3, "big": 2 ** 62, "x": 0.25, "ok": False, "reasons": ["stop", 1], "none": None, "é\"": "q\"é\n"},
         None, None),
        ("worker", tracing.child_traceparent(parent), parent[36:52], "decode", spans.INTERNAL, t0 + 7, t0 + 8,
         None, [tracing.new_traceparent(), "garbage", tracing.new_traceparent()], "RuntimeError: boom"),
    ]
    return sends[:2] + others[:1] + sends[2:] + others[1:]


def test_the_fast_encoding_is_the_otlp_json_of_each_span():
    """Sends formatted from their template, other spans joined by hand: the same spans as the OTLP
    dicts through json.dumps, and as the generic path (every send as the span it stands for)."""
    records = _sample_records()
    expected = _by_span(_reference_export(records))
    fast, generic = (_by_span(json.loads(otlp_json(records, fast=f))) for f in (True, False))
    assert fast == expected
    assert generic == expected
    assert set(expected) == {"gateway", "worker"} and sum(map(len, expected.values())) == len(records)
    assert json.loads(otlp_json([])) == {"resourceSpans": []}


@pytest.mark.parametrize("shape", ["roots", "children", "mixed parents", "another trace's parent", "a float start"])
def test_a_chunk_of_sends_of_each_shape_encodes_to_the_reference_json(shape):
    """Sends of several topics and partitions, all roots, all children, mixed, one under a parent it
    could not continue, one with a float start: the fast path (pieces around each send's template)
    and the generic encoder give the same JSON as json.dumps of the OTLP dicts."""
    parent, other = tracing.new_traceparent(), tracing.new_traceparent()
    records = []
    for i in range(40):
        topic, partition = ("chat.prompts", "chat.inference.requests")[i % 2], (None, 0, 5)[i % 3]
        if shape in ("roots", "a float start") or (shape == "mixed parents" and i % 4 == 0):
            traceparent, mine = tracing.new_traceparent(), None
        elif shape == "another trace's parent" and i == 7:
            traceparent, mine = tracing.new_traceparent(), other  # a new root under a parent it could not continue
        else:
            traceparent, mine = tracing.child_traceparent(parent), parent
        start = 1_000.0 + i if shape == "a float start" and i == 3 else 1_000 + i
        records.append(("svc", traceparent, mine, topic, partition, start, 2_000 + i))
    expected = _by_span(_reference_export(records))
    assert _by_span(json.loads(otlp_json(records))) == expected
    assert _by_span(json.loads(otlp_json(records, fast=False))) == expected
    assert len(expected["svc"]) == 40


def test_a_malformed_traceparent_given_to_record_send_is_escaped_not_written_raw():
    """Only well formed traceparents go into a send's JSON unescaped: a caller's odd one sends the
    whole batch through the escaping path, and the export stays valid JSON."""
    bad = '00-' + '"' * 32 + '-' + '\\' * 16 + '-01'
    records = [("svc", tracing.new_traceparent(), None, "t", None, 1, 2), ("svc", bad, None, "t", None, 3, 4)]
    export = json.loads(otlp_json(records))
    assert _by_span(export) == _by_span(_reference_export(records))


class _Headers:
    """A message whose headers() is a method but which is not confluent-kafka's (Faust's are an
    attribute): read one by one."""

    def __init__(self, headers):
        self._headers = headers

    def headers(self):
        return self._headers


def test_a_batch_links_each_record_alike_read_in_c_or_one_by_one(recorder, tmp_path):
    """A consumed batch of confluent-kafka Messages, their traceparent first: read without a Python
    loop. Any other batch: one by one, leaving out what is not a valid traceparent. Same links."""
    parents = [tracing.new_traceparent() for _ in range(5)]
    confluent = [Message(topic="t", value=b"v", headers=[(tracing.HEADER, p.encode())]) for p in parents]
    other = [_Headers([(tracing.HEADER, p.encode())]) for p in parents]
    mixed = [_Headers([("x", b"1"), (tracing.HEADER, parents[0].encode())]), _Headers(None),
             Message(topic="t", value=b"v", headers=[(tracing.HEADER, b"00-" + b"z" * 32 + b"-" + b"1" * 16 + b"-01")]),
             Message(topic="t", value=b"v", headers=[(tracing.HEADER, parents[1].encode())])]
    assert spans._MessageLinks(confluent).values is not None, "the batch a GroupReader polls takes the fast path"
    assert spans._MessageLinks(other).values is None and spans._MessageLinks(mixed).values is None
    tracer = spans.Tracer("svc")
    for name, batch in (("fast", confluent), ("slow", other), ("mixed", mixed)):
        tracer.record_receive(name, None, batch, 1)
    spans.flush()
    links = {row.name: row.links for row in read_span_files(tmp_path)}
    expected = [(p[3:35], p[36:52]) for p in parents]
    assert links["receive fast"] == expected and links["receive slow"] == expected
    assert links["receive mixed"] == expected[:2]
    # a header value that looks right but is not hex: left out by the fast path's check too
    values = [p.encode() for p in parents[:2]] + [b"00-" + b"g" * 32 + b"-" + b"1" * 16 + b"-01"]
    assert spans._links_json(values) is None


def test_sends_beyond_the_queue_are_dropped_oldest_first(tmp_path):
    spans.shutdown()
    rec = spans.configure("unit", spans.TracingSettings(file_dir=tmp_path, export_interval_s=60, max_queued=100))
    try:
        tracer = spans.Tracer("svc")
        sent = [tracing.new_traceparent() for _ in range(150)]
        for i, traceparent in enumerate(sent):
            tracer.record_send("t", traceparent, None, i, partition=i % 3)
        assert rec.dropped == 50
        spans.flush()
        rows = sorted(read_span_files(tmp_path), key=lambda r: r.start_ns)
        assert [r.span_id for r in rows] == [tp[36:52] for tp in sent[50:]]
        assert rows[0].attributes["messaging.destination.partition.id"] == str(50 % 3)
        assert rec.exported == 100
    finally:
        spans.shutdown()


def test_spans_the_trace_store_did_not_take_are_posted_at_the_next_export():
    """A trace store that is away (or too busy to answer) loses nothing it can get later."""
    received: list[dict] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spans.shutdown()
    spans.configure("unit", spans.TracingSettings(otlp_endpoint=f"http://127.0.0.1:{port}", export_interval_s=60))
    try:
        spans.Tracer("svc").start("while away").end()
        spans.flush()  # nobody listens on the port yet
        server = HTTPServer(("127.0.0.1", port), Receiver)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        spans.Tracer("svc").start("once back").end()
        spans.flush()
    finally:
        spans.shutdown()
        server.shutdown()
    names = [s["name"] for export in received for r in export["resourceSpans"] for sc in r["scopeSpans"]
             for s in sc["spans"]]
    assert names == ["while away", "once back"]


def test_a_large_export_is_written_in_requests_of_at_most_export_chunk_spans(tmp_path):
    """A busy interval's spans are exported in several requests (lines of the span file), none over
    EXPORT_CHUNK spans, and every span is in exactly one of them."""
    from transport import tracing

    spans.shutdown()
    spans.configure("unit", spans.TracingSettings(file_dir=tmp_path, export_interval_s=60))
    tracer, chunk = spans.Tracer("unit"), spans.EXPORT_CHUNK
    sent = [tracing.new_traceparent() for _ in range(2 * chunk + 5)]
    try:
        for i, traceparent in enumerate(sent):
            tracer.record_send("chat.prompts", traceparent, None, 1_000 + i, i % 3)
        for i in range(chunk + 1):
            tracer.start(f"step {i}").end()
        spans.flush()
    finally:
        spans.shutdown()
    lines = [json.loads(line) for path in tmp_path.glob("*.jsonl") for line in path.read_text().splitlines()]
    per_line = [[s for r in line["resourceSpans"] for scope in r["scopeSpans"] for s in scope["spans"]]
                for line in lines]
    assert len(lines) == 5 and max(map(len, per_line)) == chunk  # sends 2048+2048+5, others 2048+1
    ids = [s["spanId"] for line in per_line for s in line]
    assert len(ids) == len(set(ids)) == len(sent) + chunk + 1
    assert {t[36:52] for t in sent} <= set(ids)
