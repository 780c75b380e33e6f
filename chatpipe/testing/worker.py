"""Test harness of the worker tests: worker processes, request producers and a reader that sees
everything the workers wrote (responses, token chunks, dead letters), from the beginning."""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from chatpipe.testing.kafka import RecordWriter, StreamAssembler
from chatpipe.testing.processes import REPO, StartedProcess, start_process, stop_process, wait_until
from inference.worker.replies import ENGINE_TIME_HEADER
from schemas.codec import default_codec
from schemas.records import ChatMessage, InferenceRequest, Priority, SamplingParams, now_ms
from schemas.topics import DLQ, REPLIES, RESPONSES, WORKERS_STATUS, inference_requests_topic
from transport import clients
from transport.dedupe import attempt_of
from transport.settings import IDLE_FETCH_WAIT_MS, KafkaSettings

CHATPIPE = REPO / ".venv" / "bin" / "chatpipe"

# The engines the worker's contract tests run on (docs/worker.md, "Engines"): ours, and vLLM's in its own
# environment (infra/vllm_env.py, made by `make test`'s prerequisites; a worker without it exits naming
# `make setup-vllm`, so its tests fail rather than skip).
ENGINES = ("chatpipe", "vllm")

# Small engine so that 2 workers + the broker fit on 2 shared cores.
ENGINE_ENV = {"CHATPIPE_MAX_BATCH": "4", "CHATPIPE_KV_CACHE_TOKENS": "4096", "CHATPIPE_NUM_THREADS": "1",
              "CHATPIPE_MAX_SEQ_LEN": "512", "CHATPIPE_DEVICE": "cpu"}


def make_request(i: int, *, conversation: str | None = None, max_tokens: int = 12, priority: Priority = Priority.INTERACTIVE,
                 reply_to: str | None = None, reply_partition: int | None = 0, text: str | None = None,
                 tenant: str = "t1", **sampling) -> InferenceRequest:
    return InferenceRequest(
        request_id=f"r{i}-{uuid.uuid4().hex[:8]}", conversation_id=conversation or f"c{i}", user_id="u1", tenant=tenant,
        created_at=now_ms(), model="smollm2-135m-instruct",
        messages=[ChatMessage("user", text or f"Say something short about the number {i}.")],
        sampling=SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **sampling}), priority=priority,
        reply_to=reply_to, reply_partition=reply_partition if reply_to else None,
    )


def send_requests(kafka: KafkaSettings, requests: list[InferenceRequest], producer: RecordWriter | None = None) -> None:
    """Produce ``requests`` to their priority's topic and wait until the broker has them."""
    producer = producer or RecordWriter(kafka)
    for req in requests:
        producer.send(kafka.topic(inference_requests_topic(req.priority.value)), req, key=req.conversation_id)
    producer.flush()  # all a RecordWriter's close() does too


@dataclass
class WorkerProcess(StartedProcess):
    worker_id: str
    engine: str = "chatpipe"

    def wait_serving(self, timeout_s: float = 120) -> None:
        wait_until(lambda: "serving (intake=" in self.log(), timeout_s=timeout_s, what=f"worker {self.worker_id}",
                   proc=self.proc, log=self.log_path)

    def kill(self) -> None:
        stop_process(self.proc, 30, sig=signal.SIGKILL)

    def terminate(self, timeout_s: float = 60) -> int:
        """SIGTERM and wait; past ``timeout_s`` ``subprocess.TimeoutExpired`` (the process left running)."""
        return stop_process(self.proc, timeout_s, kill_after=False)


def start_worker(kafka: KafkaSettings, tmp_path: Path, *, intake: str = "partition", worker_id: str | None = None,
                 group_id: str = "workers", args: tuple[str, ...] = (), engine: str = "chatpipe",
                 **env: str) -> WorkerProcess:
    worker_id = worker_id or f"w-{uuid.uuid4().hex[:6]}"
    full_env = {**os.environ, **ENGINE_ENV, "CHATPIPE_WORKER_ENGINE": engine, "CHATPIPE_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
                "CHATPIPE_TOPIC_PREFIX": kafka.topic_prefix, "CHATPIPE_WORKER_INTAKE": intake,
                "CHATPIPE_WORKER_GROUP_ID": f"{kafka.topic_prefix}{group_id}", "CHATPIPE_WORKER_WORKER_ID": worker_id,
                "CHATPIPE_WORKER_HEARTBEAT_S": "1", "HF_HUB_OFFLINE": "1", **env}
    log_path = tmp_path / f"{worker_id}.log"
    proc = start_process([CHATPIPE, "inference", *args], log=log_path, env=full_env, cwd=REPO, append=False)
    return WorkerProcess(proc, log_path, worker_id, engine)


@dataclass
class Seen:
    responses: dict[str, list] = field(default_factory=dict)  # request_id -> [(Response, attempt)]
    dead_letters: list = field(default_factory=list)
    statuses: list = field(default_factory=list)
    assembler: StreamAssembler = field(default_factory=StreamAssembler)
    chunk_count: dict[str, int] = field(default_factory=dict)
    chunk_workers: dict[str, set] = field(default_factory=dict)
    engine_us: dict[str, int] = field(default_factory=dict)  # request_id -> the first chunk's engine time
    final_chunks: dict[str, list] = field(default_factory=dict)  # request_id -> its final TokenChunks
    chunks: dict[str, list] = field(default_factory=dict)  # request_id -> [(TokenChunk, attempt)], as read

    def first_response(self, request_id: str):
        """Reader-side dedupe: the first Response of a request wins."""
        got = self.responses.get(request_id)
        return got[0] if got else None


class Reader:
    """Reads chat.responses, chat.replies, chat.dlq and chat.workers.status from the beginning."""

    def __init__(self, kafka: KafkaSettings) -> None:
        self.codec = default_codec()
        self.seen = Seen()
        self._consumer = clients.consumer(kafka, f"reader-{uuid.uuid4().hex[:8]}",
                                          {"enable.auto.commit": False, "fetch.wait.max.ms": IDLE_FETCH_WAIT_MS})
        names = [kafka.topic(n) for n in (RESPONSES, REPLIES, DLQ, WORKERS_STATUS)]
        deadline = time.monotonic() + 30
        while True:  # just-created topics take a moment to show in metadata
            meta = self._consumer.list_topics(timeout=10)
            if all(n in meta.topics and meta.topics[n].partitions for n in names) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        self._consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING)
                               for topic in names for p in meta.topics[topic].partitions])

    def poll(self, timeout_s: float = 0.2) -> None:
        """Read what is there; waits at most ``timeout_s`` for the first record."""
        raw = self._consumer.consume(500, 0) or self._consumer.consume(1, timeout_s)
        for msg in raw:
            if msg.error():
                continue
            record = self.codec.decode(msg.value())
            name = type(record).__name__
            attempt = attempt_of(msg.headers())
            if name == "Response":
                self.seen.responses.setdefault(record.request_id, []).append((record, attempt))
            elif name == "TokenChunk":
                self.seen.assembler.add(record, attempt)
                self.seen.chunks.setdefault(record.request_id, []).append((record, attempt))
                self.seen.chunk_count[record.request_id] = self.seen.chunk_count.get(record.request_id, 0) + 1
                self.seen.chunk_workers.setdefault(record.request_id, set()).add(record.worker_id)
                if record.is_final:
                    self.seen.final_chunks.setdefault(record.request_id, []).append(record)
                if record.index == 0:
                    engine_us = dict(msg.headers() or []).get(ENGINE_TIME_HEADER)
                    if engine_us is not None:
                        self.seen.engine_us[record.request_id] = int(engine_us)
            elif name == "DeadLetter":
                self.seen.dead_letters.append(record)
            elif name == "WorkerStatus":
                self.seen.statuses.append(record)

    def wait_for(self, condition, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll()
            if condition(self.seen):
                return
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what() if callable(what) else what}")

    def stream_text(self, request_id: str, attempt: str | None, timeout_s: float = 30.0) -> str:
        """The whole text of that attempt's stream, once its end marker came (the worker sends the
        end marker after the Response: a reader can hold the Response first)."""
        self.wait_for(lambda s: s.assembler.text(request_id, attempt) is not None, timeout_s,
                      f"the whole stream of {request_id}")
        return self.seen.assembler.text(request_id, attempt)

    def wait_responses(self, request_ids, timeout_s: float) -> None:
        ids = set(request_ids)
        self.wait_for(lambda s: ids <= set(s.responses), timeout_s,
                      lambda: f"responses ({len(ids - set(self.seen.responses))} missing)")

    def close(self) -> None:
        self._consumer.close()
