"""The gateway's reply address: its own topic, read by one thread, chunks handed to waiting requests.

Each gateway instance owns the topic ``<prefix>chat.replies.<gateway id>`` (one partition,
created at start, kept across restarts of the same id), so it reads only the tokens of its own
requests, never a fan-out of every gateway's. The reader starts at the partition's end offset,
fixed before the gateway reports healthy, so no reply of a request sent after that is skipped.

A chunk whose request is not waiting any more (finished, cancelled, or from before a restart)
is dropped here on purpose: its request's Response on ``chat.responses`` is the record of it.

The topic carries two record types: ``TokenChunk`` (chat and completions, handed on as ``Reply``)
and ``EmbeddingResult`` (POST /v1/embeddings, streams/embedding_requests.py; handed on as it is).
Both go to the queue of the request id they name.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass

from confluent_kafka import KafkaError, TopicPartition

from schemas.codec import AvroCodec
from schemas.errors import DecodeError
from schemas.records import EmbeddingResult, TokenChunk
from schemas.topics import REPLIES
from transport import clients, tracing
from transport.admin import TopicAdmin
from transport.dedupe import attempt_of
from transport.failures import Fault, classify
from transport.settings import KafkaSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Reply:
    chunk: TokenChunk
    attempt: str | None  # the serving attempt (a worker crash makes a second one)
    traceparent: str | None = None  # the worker's span that sent the stream (the reply read links to it)


def ensure_reply_topic(kafka: KafkaSettings, gateway_id: str, retention_ms: int) -> str:
    name = kafka.topic(f"{REPLIES}.{gateway_id}")
    TopicAdmin(kafka, timeout_s=15).create_topic(name, 1, {"retention.ms": str(retention_ms), "cleanup.policy": "delete"},
                                                 exist_ok=True)
    return name


class ReplyReader:
    def __init__(self, kafka: KafkaSettings, topic: str, codec: AvroCodec) -> None:
        self.topic = topic
        self.codec = codec
        self._consumer = clients.consumer(kafka, f"chatpipe-gateway-{topic}", {  # never joined or committed
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            # The broker answers a waiting fetch as soon as a record is appended (fetch.min.bytes 1), so
            # this bounds only an idle fetch: 5 ms cost the broker ~200 idle fetches a second for the same
            # hop latency (bench/kafka_hop.py: 5 and 100 ms alike).
            "fetch.wait.max.ms": 100,
            "fetch.min.bytes": 1,
        })
        self._waiting: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        _, end = self._consumer.get_watermark_offsets(TopicPartition(self.topic, 0), timeout=15)
        self._consumer.assign([TopicPartition(self.topic, 0, end)])
        self._thread = threading.Thread(target=self._run, name="chatpipe-gateway-replies", daemon=True)
        self._thread.start()
        self.ready = True

    def register(self, request_id: str) -> asyncio.Queue:
        self._waiting[request_id] = queue = asyncio.Queue()
        return queue

    def unregister(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            # librdkafka's consume(n, t) returns after n messages or the whole t: with (500, 0.1) every
            # chunk waited 0-100 ms (most of a lone prompt's added time to first token, bench/e2e.py).
            # So: what is there now, and only when nothing is, a wait for the next one. A client's
            # follow-up sent at once still sees this answer in its context: the worker's Response
            # is on the broker before the final chunk, and intake waits for record (streams/recorded.py).
            messages = self._consumer.consume(500, 0) or self._consumer.consume(1, 0.1)
            replies = []
            for msg in messages:
                err = msg.error()
                if err is not None:
                    if err.code() != KafkaError._PARTITION_EOF:  # librdkafka reconnects; a FATAL one needs a person
                        log.log(logging.WARNING if classify(err) is Fault.TRANSIENT else logging.ERROR,
                                "reply topic %s: %s", self.topic, err.str())
                    continue
                try:
                    chunk = self.codec.decode(msg.value(), None, topic=msg.topic(), partition=msg.partition(),
                                              offset=msg.offset())
                    if not isinstance(chunk, (TokenChunk, EmbeddingResult)):
                        raise DecodeError(f"a {type(chunk).__name__}, not a TokenChunk or EmbeddingResult")
                except DecodeError as exc:  # not ours to dead-letter: the asker is unknown; say so
                    log.error("undecodable record on %s@%s: %s", self.topic, msg.offset(), exc)
                    continue
                if isinstance(chunk, EmbeddingResult):
                    replies.append(chunk)
                    continue
                headers = msg.headers()
                replies.append(Reply(chunk, attempt_of(headers), tracing.find(headers)))
            if replies and self._loop is not None:
                self._loop.call_soon_threadsafe(self._dispatch, replies)

    def _dispatch(self, replies: list[Reply | EmbeddingResult]) -> None:
        for reply in replies:
            queue = self._waiting.get(reply.chunk.request_id if isinstance(reply, Reply) else reply.request_id)
            if queue is not None:
                queue.put_nowait(reply)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._consumer.close()
