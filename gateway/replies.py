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

The same reader tails ``chat.workers.status`` (from its end: a report comes every heartbeat) and hands
each ``WorkerStatus`` to ``on_status``: the fleet's load that admission estimates from (``fleet.py``).
One consumer for both, so one failure path: a reader that stops stops both.

A reader that stops (its topic deleted, the broker away past the retry budget, a bug) does not
stop quietly: ``ReplyReader`` says so to every waiting request and to the gateway, which exits
non-zero to be restarted (``service.py``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Callable

from schemas.codec import AvroCodec
from schemas.errors import DecodeError
from schemas.records import EmbeddingResult, TokenChunk, WorkerStatus
from schemas.topics import REPLIES, WORKERS_STATUS
from transport import tracing
from transport.admin import TopicAdmin
from transport.dedupe import attempt_of
from transport.message import ConsumedMessage
from transport.settings import IDLE_FETCH_WAIT_MS, KafkaSettings
from transport.tail_reader import TailReader

log = logging.getLogger(__name__)


class ReplyReaderStopped(Exception):
    """Put on every waiting request's queue when the reply reader stops: no reply can reach them."""


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
    """The reply topic's one reader: a ``TailReader`` in a thread of its own.

    If the thread dies (an error the failure policy does not pass, transient errors past
    ``error_budget_s``, the topic deleted) the reader is not ready any more, every waiting request
    gets ``ReplyReaderStopped`` on its queue, and ``on_failure`` runs on the event loop: the gateway
    stops taking requests and exits non-zero for its supervisor to restart it (``GatewayService``),
    rather than stay healthy while every request waits out its timeout."""

    def __init__(self, kafka: KafkaSettings, topic: str, codec: AvroCodec, error_budget_s: float = 60.0,
                 on_status: Callable[[WorkerStatus], None] | None = None) -> None:
        self.kafka = kafka
        self.topic = topic
        self.on_status = on_status  # None: the workers' status topic is not read
        self.codec = codec
        self.error_budget_s = error_budget_s
        self._waiting: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_failure: Callable[[BaseException], None] = lambda exc: None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumer: TailReader | None = None
        self.ready = False
        self.failure: BaseException | None = None

    def start(self, loop: asyncio.AbstractEventLoop, on_failure: Callable[[BaseException], None]) -> None:
        """Positions the reader at the topic's end (before this returns: no later reply is skipped)
        and starts its thread."""
        self._loop, self._on_failure = loop, on_failure
        # A deleted topic is found by a metadata check (TailReader): a few of them within the budget.
        topics = [self.topic] + ([self.kafka.topic(WORKERS_STATUS)] if self.on_status is not None else [])
        self._consumer = TailReader(self.kafka, topics=topics, timeout_s=15, error_budget_s=self.error_budget_s,
                                    topic_check_s=min(10.0, self.error_budget_s / 3),
                                    extra_config={
                                        # The broker answers a waiting fetch as soon as a record is appended
                                        # (fetch.min.bytes 1), so this bounds only an idle fetch: 5 ms cost the
                                        # broker ~200 idle fetches a second for the same hop latency
                                        # (bench/kafka_hop.py: 5 and 100 ms alike).
                                        "fetch.wait.max.ms": IDLE_FETCH_WAIT_MS,
                                        "fetch.min.bytes": 1,
                                    })
        self._thread = threading.Thread(target=self._run, name="chatpipe-gateway-replies", daemon=True)
        self._thread.start()
        self.ready = True

    def register(self, request_id: str) -> asyncio.Queue:
        self._waiting[request_id] = queue = asyncio.Queue()
        return queue

    def unregister(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                # What is there now, and only when nothing is, a wait for the next one (TailReader): a
                # consume(500, 0.1) would hold every chunk 0-100 ms (most of a lone prompt's added time to
                # first token, bench/e2e.py). A client's follow-up sent at once still sees this answer in
                # its context: the worker's Response is on the broker before the final chunk, and intake
                # waits for record (streams/recorded.py).
                replies = self._decode(self._consumer.poll_messages(500, 0.1))
                if replies:
                    self._loop.call_soon_threadsafe(self._dispatch, replies)
        except BaseException as exc:  # noqa: BLE001 - whatever stopped the reader, the gateway must hear of it
            if self._stop.is_set():  # closing (close() timed out joining and closed the consumer): no failure
                return
            log.critical("reply reader of %s stopped: %s: %s", self.topic, type(exc).__name__, exc)
            try:
                self._loop.call_soon_threadsafe(self._stopped, exc)
            except RuntimeError:  # the loop is closed: the gateway has stopped already
                pass

    def _stopped(self, exc: BaseException) -> None:
        """On the loop: not ready any more, every waiting request hears it (``ReplyReaderStopped``), then
        the gateway."""
        self.ready, self.failure = False, exc
        stopped = ReplyReaderStopped(f"{type(exc).__name__}: {exc}")
        for queue in self._waiting.values():
            queue.put_nowait(stopped)
        self._on_failure(exc)

    def _decode(self, messages: list[ConsumedMessage]) -> list[Reply | EmbeddingResult | WorkerStatus]:
        replies: list[Reply | EmbeddingResult | WorkerStatus] = []
        for msg in messages:
            if msg.value is None:  # a tombstone on the compacted status topic
                continue
            try:
                chunk = self.codec.decode(msg.value, None, topic=msg.topic, partition=msg.partition, offset=msg.offset)
                if not isinstance(chunk, (TokenChunk, EmbeddingResult, WorkerStatus)):
                    raise DecodeError(f"a {type(chunk).__name__}, not a TokenChunk, EmbeddingResult or WorkerStatus")
            except DecodeError as exc:  # not ours to dead-letter: the asker is unknown; say so
                log.error("undecodable record on %s@%s: %s", msg.topic, msg.offset, exc)
                continue
            if isinstance(chunk, (EmbeddingResult, WorkerStatus)):
                replies.append(chunk)
                continue
            replies.append(Reply(chunk, attempt_of(msg.headers), tracing.find(msg.headers)))
        return replies

    def _dispatch(self, replies: list[Reply | EmbeddingResult | WorkerStatus]) -> None:
        for reply in replies:
            if isinstance(reply, WorkerStatus):
                self.on_status(reply)
                continue
            queue = self._waiting.get(reply.chunk.request_id if isinstance(reply, Reply) else reply.request_id)
            if queue is not None:
                queue.put_nowait(reply)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._consumer is not None:
            self._consumer.close()
