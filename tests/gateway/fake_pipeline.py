"""A stand-in for streams + the inference worker, for gateway tests that need no model: it reads the
``PromptRequest``s a gateway puts on ``chat.prompts`` and answers each at its reply address the way
the real tiers do (token chunks, the last one saying how the request ended), or not at all.

What to answer is the test's ``answer(prompt) -> list[TokenChunk] | None`` (None: stay silent).
Prompts of conversations the test does not know (other tests share the session's topics) are
ignored by the test's ``answer``.

Like a worker it reports on ``chat.workers.status`` every second (SERVING the default model), so the
gateway's admission has a worker to send to (transport/fleet.py); the report has no batch size, so no
estimate refuses anything.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Callable

from confluent_kafka import Consumer, TopicPartition

from chatpipe.testing.kafka import RecordWriter
from schemas.codec import default_codec
from schemas.records import FinishReason, PromptRequest, TokenChunk, WorkerState, WorkerStatus
from transport.dedupe import ATTEMPT_HEADER
from transport.settings import IDLE_FETCH_WAIT_MS, KafkaSettings

Answer = Callable[[PromptRequest], list[TokenChunk] | None]
MODEL = "smollm2-135m-instruct"  # the gateway's default model


def final(prompt: PromptRequest, text: str = "", *, index: int = 0, finish_reason: FinishReason = FinishReason.STOP,
          error_code: str | None = None, error: str | None = None) -> TokenChunk:
    return TokenChunk(request_id=prompt.request_id, conversation_id=prompt.conversation_id, index=index, text=text,
                      is_final=True, worker_id="fake-worker", finish_reason=finish_reason, tokens_in=3,
                      tokens_out=len(text.split()), error_code=error_code, error=error)


class FakePipeline:
    def __init__(self, kafka: KafkaSettings, answer: Answer) -> None:
        self.kafka = kafka
        self.answer = answer
        self.codec = default_codec()
        self.prompts: dict[str, PromptRequest] = {}  # conversation id -> the last prompt seen
        self._producer = RecordWriter(kafka, extra_config={"linger.ms": 0})
        self._reports = RecordWriter(kafka, extra_config={"linger.ms": 0})
        self._consumer = Consumer({**kafka.client_config(), "group.id": f"fake-pipeline-{uuid.uuid4().hex[:8]}",
                                   "enable.auto.commit": False, "fetch.wait.max.ms": IDLE_FETCH_WAIT_MS})
        topic = kafka.topic("chat.prompts")
        partitions = self._consumer.list_topics(topic, timeout=15).topics[topic].partitions
        ends = [self._consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=15)[1] for p in partitions]
        self._consumer.assign([TopicPartition(topic, p, end) for p, end in zip(partitions, ends)])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-pipeline", daemon=True)
        self.errors: list[BaseException] = []

    def start(self) -> "FakePipeline":
        self._thread.start()
        return self

    def _report(self) -> None:
        status = WorkerStatus(worker_id="fake-worker", model=MODEL, state=WorkerState.SERVING, running=0, waiting=0,
                              kv_cache_used_tokens=0, kv_cache_total_tokens=1, tokens_per_s=0.0)
        # Its own writer, never flushed: a report lost while the broker is away is replaced by the next
        # one, and must not fail an answer's flush (test_deadlines_and_outages.py stops the broker).
        self._reports.send(self.kafka.topic("chat.workers.status"), status, key=status.worker_id)

    def _run(self) -> None:
        try:
            reported = 0.0
            while not self._stop.is_set():
                if time.monotonic() - reported >= 1.0:
                    self._report()
                    reported = time.monotonic()
                for msg in self._consumer.consume(100, 0.1):
                    if msg.error() is not None:  # partition EOF, or the broker away: librdkafka reconnects
                        continue
                    prompt = self.codec.decode(msg.value(), PromptRequest)
                    self.prompts[prompt.conversation_id] = prompt
                    chunks = self.answer(prompt)
                    for chunk in chunks or ():
                        self._producer.send(prompt.reply_to, chunk, key=prompt.request_id,
                                            partition=prompt.reply_partition, headers=[(ATTEMPT_HEADER, b"fake-1")])
                    if chunks:
                        self._producer.flush(30)
        except BaseException as exc:  # noqa: BLE001 - reported by stop(), in the test
            self.errors.append(exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self._consumer.close()
        assert not self.errors, f"the fake pipeline failed: {self.errors!r}"
