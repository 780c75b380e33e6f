"""One trace per request across every hop, read back from the span files the real processes write.

The session's ``pipeline`` (streams, inference worker with the default model, gateway: real
processes on the session broker) writes OTLP/JSON spans under ``pipeline.traces_dir``
(transport/spans.py). Two requests: one through the gateway's HTTP API, one produced straight to
``chat.prompts`` with the producer's own ``traceparent`` (docs/producing.md). Each trace must hold
a span of every hop, each parented to the span that produced its input record, and the batch
consumes must link to the records' producer spans. The turn's archive record, and its row in the
fine-tuning dataset built from that archive, carry the trace id.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
import uuid

import httpx
import pytest
from confluent_kafka import Producer

from chatpipe.testing.gateway import API_KEY
from chatpipe.testing.worker import CHATPIPE
from clients.traces import SpanRow, read_span_files, trace_of_request
from schemas.codec import default_codec
from schemas.records import ChatMessage, ConversationTurn, PromptRequest, SamplingParams
from schemas.topics import PROMPTS, TURNS
from transport import spans
from transport.archive import read_messages
from transport.spans import CLIENT, CONSUMER, PRODUCER, SERVER

pytestmark = [pytest.mark.integration, pytest.mark.model]
MODEL = "smollm2-135m-instruct"


def wait_for_trace(pipeline, request_id: str, check, timeout_s: float = 90.0):
    """``check(spans)``'s result once it passes on the request's spans. Each service exports its
    spans every 0.5 s on its own, so the last hop's span can be on disk before an earlier hop's
    (the gateway's HTTP span ends after the reply stream): poll until every hop the check asserts
    is there, and on timeout raise the check's own failure with the spans that were found."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = trace_of_request(read_span_files(pipeline.traces_dir), request_id)
        try:
            return rows, check(rows)
        except AssertionError as missing:
            if time.monotonic() >= deadline:
                names = sorted(f"{r.service}:{r.name}" for r in rows)
                raise AssertionError(f"trace of {request_id} incomplete after {timeout_s:g} s: {missing}; "
                                     f"spans: {names}") from missing
        time.sleep(0.5)


def find(rows: list[SpanRow], service: str, *, starts: str, contains: str = "", kind: int | None = None,
         trace_id: str | None = None) -> list[SpanRow]:
    return [r for r in rows if r.service == service and r.name.startswith(starts) and contains in r.name
            and (kind is None or r.kind == kind) and (trace_id is None or r.trace_id == trace_id)]


def one(rows: list[SpanRow], service: str, **match) -> SpanRow:
    found = find(rows, service, **match)
    assert len(found) == 1, f"{service} {match}: {len(found)} span(s): {[r.name for r in found]}"
    return found[0]


def check_pipeline_hops(rows: list[SpanRow], trace_id: str, prompt_send_id: str) -> dict[str, SpanRow]:
    """The hops from intake to the archive, in ``trace_id``, intake a child of ``prompt_send_id``."""
    own = [r for r in rows if r.trace_id == trace_id]
    intake = one(own, "streams", starts="process", contains=".chat.prompts", kind=CONSUMER)
    assert intake.parent_id == prompt_send_id, "intake is not the child of the prompt's producer span"
    steps = {r.name: r for r in own if r.parent_id == intake.span_id and r.kind == spans.INTERNAL}
    assert {"embed", "recall", "assemble"} <= set(steps), f"intake's steps: {sorted(steps)}"
    assert steps["embed"].attributes["chatpipe.batch.size"] >= 1
    assert steps["assemble"].attributes["chatpipe.context.tokens"] > 0
    request_send = one(own, "streams", starts="send", contains="chat.inference.requests", kind=PRODUCER)
    assert request_send.parent_id == intake.span_id

    worker = one(own, "inference", starts="process", contains="chat.inference.requests", kind=CONSUMER)
    assert worker.parent_id == request_send.span_id
    chat = one(own, "inference", starts="chat ")
    assert chat.parent_id == worker.span_id
    assert chat.attributes["gen_ai.usage.output_tokens"] > 0 and chat.attributes["gen_ai.usage.input_tokens"] > 0
    assert chat.attributes["gen_ai.response.finish_reasons"] in (["stop"], ["length"])
    assert "gen_ai.input.messages" not in chat.attributes, "prompt text on a span without content capture"
    for step in ("prefill", "decode"):
        assert one(own, "inference", starts=step).parent_id == chat.span_id
    assert one(own, "inference", starts="queue wait").parent_id == worker.span_id
    response_send = one(own, "inference", starts="send", contains="chat.responses", kind=PRODUCER)
    assert response_send.parent_id == worker.span_id

    record = one(own, "streams", starts="process", contains="chat.responses", kind=CONSUMER)
    assert record.parent_id == response_send.span_id
    turn_send = one(own, "streams", starts="send", contains="chat.turns", kind=PRODUCER)
    assert turn_send.parent_id == record.span_id
    # chat.turns has two consumers in this trace: the archive and the memory writer (its own group)
    turn_readers = {r.attributes.get("messaging.consumer.group.name", "").endswith(".memory"): r
                    for r in find(own, "streams", starts="process", contains="chat.turns", kind=CONSUMER)}
    archive, memory_writer = turn_readers.get(False), turn_readers.get(True)
    assert archive is not None and archive.parent_id == turn_send.span_id, "no archive span under the turn's send"
    assert memory_writer is not None and memory_writer.parent_id == turn_send.span_id, "no memory writer span"
    assert {"embed", "memory upsert"} <= {r.name for r in own if r.parent_id == memory_writer.span_id}

    # Batch consumes are spans of their own traces, linked to each record's producer span.
    for service, topic, producer_span in (("streams", ".chat.prompts", prompt_send_id),
                                          ("inference", "chat.inference.requests", request_send.span_id),
                                          ("streams", ".chat.responses", response_send.span_id)):
        batches = [r for r in rows if r.trace_id != trace_id and r.service == service and r.kind == CLIENT
                   and r.name.startswith("receive") and topic in r.name]
        assert any((trace_id, producer_span) in r.links for r in batches), \
            f"no {service} batch receive of {topic} links to the record's producer span"
    return {"intake": intake, "worker": worker, "record": record, "turn_send": turn_send, "archive": archive}


def archived_turn(pipeline, request_id: str, timeout_s: float = 60.0) -> tuple[ConversationTurn, list]:
    """The request's turn as the archive keeps it: the decoded record and the archived headers."""
    codec = default_codec()
    root = pipeline.streams.archive_dir / pipeline.kafka.topic(TURNS)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for path in sorted(root.glob("date=*/hour=*/*.avro")):
            for m in read_messages(path):
                turn = codec.decode(m.value)
                if isinstance(turn, ConversationTurn) and turn.request_id == request_id:
                    return turn, list(m.headers)
        time.sleep(0.5)
    raise AssertionError(f"turn of {request_id} not archived under {root} within {timeout_s:g} s")


def dataset_row(pipeline, request_id: str, out) -> dict:
    """The request's row in the fine-tuning dataset built from the archive (``sft``, or ``dropped``
    with its reason when a filter left it out: both carry the lineage columns)."""
    import pyarrow.parquet as pq

    now = int(time.time() * 1000)
    built = subprocess.run(
        [str(CHATPIPE), "job", "finetune-dataset", "--out", str(out), "--source", "archive",
         "--archive-dir", str(pipeline.streams.archive_dir), "--topic-prefix", pipeline.kafka.topic_prefix,
         "--since", str(now - 3_600_000), "--until", str(now + 3_600_000), "--master", "local[2]",
         "--shuffle-partitions", "2", "--quiet"], capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    for table in ("sft", "dropped"):
        folder = out / "parquet" / table
        if folder.is_dir():
            rows = [r for r in pq.read_table(folder).to_pylist() if r.get("request_id") == request_id]
            if rows:
                return rows[0]
    raise AssertionError(f"request {request_id} is in no dataset table under {out}")


def check_gateway_trace(rows: list[SpanRow]) -> tuple[SpanRow, dict[str, SpanRow]]:
    """Every hop of a gateway request: the HTTP span, its prompt send and reply read, the pipeline's hops."""
    http = one(rows, "gateway", starts="POST /v1/chat/completions", kind=SERVER)
    assert http.parent_id is None, "a request without a traceparent header starts its own trace"
    assert http.attributes["chatpipe.outcome"] == "ok" and http.error is None
    trace_id = http.trace_id
    prompt_send = one(rows, "gateway", starts="send", contains=".chat.prompts", kind=PRODUCER, trace_id=trace_id)
    assert prompt_send.parent_id == http.span_id
    hops = check_pipeline_hops(rows, trace_id, prompt_send.span_id)

    chunks = one(rows, "inference", starts="send", contains="replies.", kind=PRODUCER, trace_id=trace_id)
    assert chunks.parent_id == hops["worker"].span_id
    assert chunks.attributes["messaging.batch.message_count"] >= 2  # text chunks and the end marker
    read = one(rows, "gateway", starts="receive", contains="replies.", kind=CONSUMER, trace_id=trace_id)
    assert read.parent_id == http.span_id
    assert (trace_id, chunks.span_id) in read.links, "the reply read does not link to the worker's chunk stream"
    assert read.attributes["messaging.batch.message_count"] == chunks.attributes["messaging.batch.message_count"]
    # The hops happen in order, within the HTTP request's span.
    assert http.start_ns <= prompt_send.start_ns <= hops["intake"].start_ns <= hops["worker"].start_ns
    assert read.end_ns <= http.end_ns + 5_000_000  # (clocks of one machine; 5 ms for the SSE tail)
    return http, hops


def test_a_gateway_request_is_one_trace_from_the_http_call_to_the_archive(pipeline, tmp_path):
    r = httpx.post(f"{pipeline.url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                         "temperature": 0, "stream": True, "user": f"trace-{uuid.uuid4().hex[:8]}"}, timeout=300)
    assert r.status_code == 200, r.text
    request_id = r.headers["X-Chatpipe-Request-Id"]
    _, (http, hops) = wait_for_trace(pipeline, request_id, check_gateway_trace)
    trace_id = http.trace_id

    turn, headers = archived_turn(pipeline, request_id)
    assert turn.trace_id == trace_id, "the archived turn does not carry its trace id"
    archived_traceparent = dict(headers)["traceparent"].decode()
    assert archived_traceparent == f"00-{trace_id}-{hops['turn_send'].span_id}-01"
    row = dataset_row(pipeline, request_id, tmp_path / "dataset")
    assert row["trace_id"] == trace_id, f"the dataset row does not lead back to the trace: {row}"

    # The same trace through `chatpipe trace`: every service, the hops in the waterfall.
    shown = subprocess.run([str(CHATPIPE), "trace", request_id, "--traces-dir", str(pipeline.traces_dir)],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    for expected in ("POST /v1/chat/completions", "process", "embed", "recall", "prefill", "decode",
                     "chat.turns", "gateway", "streams", "inference", trace_id):
        assert expected in shown.stdout, f"{expected!r} missing from `chatpipe trace`:\n{shown.stdout}"
    as_json = subprocess.run([str(CHATPIPE), "trace", request_id, "--traces-dir", str(pipeline.traces_dir), "--json"],
                             capture_output=True, text=True, timeout=60)
    listed = [json.loads(line) for line in as_json.stdout.splitlines()]
    on_disk = trace_of_request(read_span_files(pipeline.traces_dir), request_id)  # (spans exported since the wait)
    assert {s["span_id"] for s in listed} == {s.span_id for s in on_disk}


def test_a_prompt_produced_with_its_own_traceparent_continues_the_producers_trace(pipeline):
    kafka = pipeline.kafka
    trace_id, parent_span = f"{random.getrandbits(128):032x}", f"{random.getrandbits(64):016x}"
    request_id = f"direct-{uuid.uuid4().hex[:12]}"
    prompt = PromptRequest(request_id=request_id, conversation_id=f"conv-{uuid.uuid4().hex[:8]}",
                           user_id=f"trace-{uuid.uuid4().hex[:8]}", tenant="acme", model=MODEL,
                           messages=[ChatMessage("user", "Name a fruit.")], sampling=SamplingParams(max_tokens=8))
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    producer.produce(kafka.topic(PROMPTS), default_codec().encode(prompt), key=prompt.conversation_id,
                     headers=[("traceparent", f"00-{trace_id}-{parent_span}-01".encode())])
    assert producer.flush(30) == 0
    rows, _ = wait_for_trace(pipeline, request_id, lambda rows: check_pipeline_hops(rows, trace_id, parent_span))
    assert {r.trace_id for r in rows if r.attributes.get("chatpipe.request_id") == request_id} == {trace_id}
    assert not [r for r in rows if r.service == "gateway"], "the gateway had no part in this request"
    turn, _ = archived_turn(pipeline, request_id)
    assert turn.trace_id == trace_id
