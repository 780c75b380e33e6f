"""Reading recorded spans back: a request's trace as a waterfall (``chatpipe trace REQUEST_ID``).

Spans come from the OTLP/JSON files the services write under ``<state>/traces``
(``transport/spans.py``), or from a trace store's query API (Jaeger's ``/api/traces``, when
``up --observability`` runs one). A request is found by its ``chatpipe.request_id`` attribute,
which the gateway, intake, the worker and record put on their spans; the trace is every span with
that trace id, plus the batch "receive" spans of other traces that link to one of them (a batch
consume has no single parent: OpenTelemetry's messaging conventions).
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
_KIND_NUMBERS = {name: number for number, name in KINDS.items()}
REQUEST_ID = "chatpipe.request_id"
# Attributes worth a column in the waterfall, in this order, with their short label (the rest: ``--all``).
SHOWN = {"messaging.destination.partition.id": "partition", "messaging.batch.message_count": "messages",
         "chatpipe.batch.size": "batch", "chatpipe.recall.hits": "hits", "chatpipe.context.tokens": "context_tokens",
         "gen_ai.usage.input_tokens": "in", "gen_ai.usage.output_tokens": "out",
         "gen_ai.response.finish_reasons": "finish", "gen_ai.server.time_to_first_token": "ttft_s",
         "chatpipe.unrecorded": "unrecorded", "chatpipe.outcome": "outcome"}


@dataclass
class SpanRow:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    links: list[tuple[str, str]] = field(default_factory=list)
    error: str | None = None

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


# OTLP/JSON AnyValue fields, and how each is read (int64 comes as a string in OTLP/JSON)
_SCALARS = (("stringValue", str), ("intValue", int), ("doubleValue", float), ("boolValue", bool))


def _value(v: dict[str, Any]) -> Any:
    for name, read in _SCALARS:
        if name in v:
            return read(v[name])
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    return None


def _attributes(items: Iterable[dict[str, Any]] | None) -> dict[str, Any]:
    return {a["key"]: _value(a.get("value", {})) for a in items or ()}


def spans_of_export(export: dict[str, Any]) -> Iterator[SpanRow]:
    """The spans of one OTLP/JSON ExportTraceServiceRequest."""
    for resource_spans in export.get("resourceSpans", []):
        service = _attributes(resource_spans.get("resource", {}).get("attributes")).get("service.name", "?")
        for scope in resource_spans.get("scopeSpans", []):
            for s in scope.get("spans", []):
                status = s.get("status") or {}
                yield SpanRow(trace_id=s["traceId"], span_id=s["spanId"], parent_id=s.get("parentSpanId") or None,
                              name=s.get("name", ""), service=service, kind=int(s.get("kind", 1)),
                              start_ns=int(s["startTimeUnixNano"]), end_ns=int(s["endTimeUnixNano"]),
                              attributes=_attributes(s.get("attributes")),
                              links=[(link["traceId"], link["spanId"]) for link in s.get("links", [])],
                              error=status.get("message") if status.get("code") == 2 else None)


def read_span_files(folder: Path) -> list[SpanRow]:
    """Every span in ``folder``'s ``*.jsonl`` files (and their rotated ``.jsonl.1``); a line cut short
    by a process killed mid-write is skipped."""
    rows: list[SpanRow] = []
    for path in sorted(folder.glob("*.jsonl*")):
        with path.open(encoding="utf-8") as f:
            for line in f:
                try:
                    rows.extend(spans_of_export(json.loads(line)))
                except (json.JSONDecodeError, KeyError, ValueError):
                    continue
    return rows


def trace_of_request(rows: list[SpanRow], request_id: str) -> list[SpanRow]:
    """The spans of ``request_id``'s trace(s), and the batch spans linking into them, by start time."""
    trace_ids = {r.trace_id for r in rows if r.attributes.get(REQUEST_ID) == request_id}
    if not trace_ids:
        return []
    own = [r for r in rows if r.trace_id in trace_ids]
    # A link into the trace, even to a span not recorded here (a producer's own, outside chatpipe).
    linked = [r for r in rows if r.trace_id not in trace_ids and any(t in trace_ids for t, _ in r.links)]
    return sorted(own + linked, key=lambda r: r.start_ns)


def jaeger_trace(query_url: str, request_id: str, timeout_s: float = 5.0) -> list[SpanRow]:
    """The request's trace from Jaeger's query API: a search by the request id tag, service by
    service (Jaeger's search needs one; a prompt produced straight to Kafka has no gateway span)."""
    found: list[dict[str, Any]] = []
    for service in ("gateway", "streams", "inference"):
        params = urllib.parse.urlencode({"service": service, "tags": json.dumps({REQUEST_ID: request_id}),
                                         "limit": 5, "lookback": "7d"})
        with urllib.request.urlopen(f"{query_url.rstrip('/')}/api/traces?{params}", timeout=timeout_s) as response:
            found = json.load(response).get("data") or []
        if found:
            break
    rows: list[SpanRow] = []
    for trace in found:
        processes = {k: v.get("serviceName", "?") for k, v in trace.get("processes", {}).items()}
        for s in trace.get("spans", []):
            tags = {t["key"]: t.get("value") for t in s.get("tags", [])}
            parent = next((r["spanID"] for r in s.get("references", []) if r.get("refType") == "CHILD_OF"), None)
            links = [(r["traceID"], r["spanID"]) for r in s.get("references", []) if r.get("refType") == "FOLLOWS_FROM"]
            kind = _KIND_NUMBERS.get(str(tags.get("span.kind")), 1)
            start_ns = int(s["startTime"]) * 1000
            rows.append(SpanRow(trace_id=s["traceID"], span_id=s["spanID"], parent_id=parent, name=s["operationName"],
                                service=processes.get(s.get("processID"), "?"), kind=kind, start_ns=start_ns,
                                end_ns=start_ns + int(s["duration"]) * 1000, attributes=tags, links=links,
                                error=str(tags.get("otel.status_description", "error")) if tags.get("error") else None))
    return sorted(rows, key=lambda r: r.start_ns)


def tree_order(rows: list[SpanRow]) -> list[SpanRow]:
    """Depth-first by start time: each span right under its parent, like a trace UI's waterfall."""
    ids = {r.span_id for r in rows}
    children: dict[str | None, list[SpanRow]] = {}
    for r in rows:
        children.setdefault(r.parent_id if r.parent_id in ids else None, []).append(r)
    out: list[SpanRow] = []

    def walk(parent: str | None) -> None:
        for r in sorted(children.get(parent, []), key=lambda r: r.start_ns):
            out.append(r)
            walk(r.span_id)

    walk(None)
    return out
