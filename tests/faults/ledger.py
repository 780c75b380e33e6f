"""The fault tests' bookkeeping: steady load with a ledger of every request sent, and an observer
that reads everything the pipeline wrote about them.

Two routes, as a user's applications would use the stack: the OpenAI gateway (HTTP, non-streaming,
the gateway's own reply topic) and a ``PromptRequest`` produced straight to ``chat.prompts`` with the
catalog's ``chat.replies`` as its reply address. The observer reads the reply topics, ``chat.turns``
and ``chat.dlq`` from the beginning in one consumer thread; the tests then compare what was sent
with what came back, request by request.
"""

from __future__ import annotations

import itertools
import random
import re
import threading
import time
import uuid
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
from confluent_kafka import Consumer, Producer

from schemas.codec import default_codec
from schemas.records import (ChatMessage, ConversationTurn, DeadLetter, FinishReason, PromptRequest, SamplingParams,
                             TokenChunk, now_ms)

REPLY_TOPIC = "chat.replies"  # the catalog's reply topic for direct producers (6 partitions)
REPLY_PARTITIONS = 6
ANSWERED = (FinishReason.STOP, FinishReason.LENGTH)
MAX_TOKENS = 6
QUESTIONS = ("Name a colour.", "Say hello.", "What is two plus two?", "Name a fruit.", "Say a short word.")


@dataclass
class Sent:
    """One request of the ledger. ``request_id`` is known at once for direct requests and from the
    reply for gateway ones; ``outcome`` is set once, by the HTTP reply or the first final chunk."""

    seq: int
    route: str  # "gateway" | "direct"
    scenario: str
    sent_at: float
    request_id: str | None = None
    outcome: str | None = None  # "answered" | "errored" | "stuck" (HTTP client gave up waiting)
    detail: str = ""


@dataclass
class Observed:
    """What the pipeline wrote, by request id (final chunks may repeat after a redelivery)."""

    finals: dict[str, list[TokenChunk]] = field(default_factory=lambda: defaultdict(list))
    turns: dict[str, list[ConversationTurn]] = field(default_factory=lambda: defaultdict(list))
    dead_letters: list[DeadLetter] = field(default_factory=list)


class Observer:
    """One consumer thread on the reply topics (gateway ones by pattern), ``chat.turns`` and ``chat.dlq``."""

    def __init__(self, bootstrap: str) -> None:
        self.seen = Observed()
        self.lock = threading.Lock()
        self.read_count = 0
        self.last_read_at = time.monotonic()
        self.errors: deque[str] = deque(maxlen=20)  # what the consumer itself reported (for a failure's detail)
        self._stop = threading.Event()
        self._consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"faults-observer-{uuid.uuid4().hex[:6]}",
                                   "auto.offset.reset": "earliest", "enable.auto.commit": False,
                                   "topic.metadata.refresh.interval.ms": 2000})
        self._consumer.subscribe([r"^chat\.replies.*", "chat.turns", "chat.dlq"])
        self._thread = threading.Thread(target=self._run, name="faults-observer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        codec = default_codec()
        while not self._stop.is_set():
            try:
                messages = self._consumer.consume(500, 0.5)
            except Exception as exc:  # noqa: BLE001 - the test's own consumer failing is not a lost record
                self.errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.5)
                continue
            for msg in messages:
                if msg.error() is not None:
                    self.errors.append(str(msg.error()))
                    continue
                if msg.value() is None:
                    continue
                self.read_count += 1
                self.last_read_at = time.monotonic()
                try:
                    record = codec.decode(msg.value())
                except Exception:  # noqa: BLE001 - a poison record the test itself put on a topic
                    continue
                with self.lock:
                    if isinstance(record, TokenChunk) and record.is_final:
                        self.seen.finals[record.request_id].append(record)
                    elif isinstance(record, ConversationTurn):
                        self.seen.turns[record.request_id].append(record)
                    elif isinstance(record, DeadLetter):
                        self.seen.dead_letters.append(record)

    def final_of(self, request_id: str) -> TokenChunk | None:
        with self.lock:
            finals = self.seen.finals.get(request_id)
            return finals[0] if finals else None

    def wait_caught_up(self, quiet_s: float = 5.0, timeout_s: float = 90.0) -> None:
        """Until it has read something and then nothing new for ``quiet_s`` (it reads from the beginning)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.read_count and time.monotonic() - self.last_read_at > quiet_s:
                return
            time.sleep(0.5)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(10)
        self._consumer.close()


class Load:
    """Steady load: one request every ``interval_s``, alternating gateway and direct, until ``stop``.

    Gateway requests run in a small thread pool (each HTTP call waits for its answer); direct ones
    are produced and their outcome is read by the observer. Conversations repeat, so memory and
    the conversation table are exercised as in real use.
    """

    def __init__(self, gateway_url: str, api_key: str, bootstrap: str, observer: Observer, *,
                 interval_s: float = 1.0, http_timeout_s: float = 240.0) -> None:
        self.gateway_url, self.api_key, self.observer = gateway_url, api_key, observer
        self.interval_s, self.http_timeout_s = interval_s, http_timeout_s
        self.ledger: list[Sent] = []
        self.scenario = "warmup"
        self._seq = itertools.count()
        self._producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                                   "partitioner": "murmur2_random"})
        self._pool = ThreadPoolExecutor(32, thread_name_prefix="faults-http")
        self._calls: list[Future] = []
        self._running = threading.Event()
        self._thread: threading.Thread | None = None
        self._rng = random.Random(7)

    # -- sending -----------------------------------------------------------------------------------

    def start(self, scenario: str) -> None:
        self.scenario = scenario
        self._running.set()
        self._thread = threading.Thread(target=self._run, name="faults-load", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._running.clear()
        if self._thread is not None:
            self._thread.join()
        self._producer.flush(30)

    def _run(self) -> None:
        while self._running.is_set():
            seq = next(self._seq)
            if seq % 2 == 0:
                self._send_gateway(seq)
            else:
                self._send_direct(seq)
            time.sleep(self.interval_s)

    def _conversation(self, seq: int) -> tuple[str, str]:
        n = seq % 5
        return f"faults-conv-{n}", f"faults-user-{n}"

    def _send_gateway(self, seq: int) -> None:
        sent = Sent(seq, "gateway", self.scenario, time.monotonic())
        self.ledger.append(sent)
        conversation, user = self._conversation(seq)
        body = {"model": "smollm2-135m-instruct", "max_tokens": MAX_TOKENS, "temperature": 0, "user": user,
                "messages": [{"role": "user", "content": self._rng.choice(QUESTIONS)}]}
        self._calls.append(self._pool.submit(self._call, sent, body, conversation))

    def _call(self, sent: Sent, body: dict, conversation: str) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}", "X-Chatpipe-Conversation-Id": conversation}
        try:
            reply = httpx.post(f"{self.gateway_url}/v1/chat/completions", json=body, headers=headers,
                               timeout=self.http_timeout_s)
        except httpx.TimeoutException:
            sent.outcome, sent.detail = "stuck", f"no HTTP answer within {self.http_timeout_s} s"
            return
        except httpx.HTTPError as exc:  # connection refused: the gateway process is down
            sent.outcome, sent.detail = "errored", f"{type(exc).__name__}: {exc}"
            return
        sent.request_id = reply.headers.get("X-Chatpipe-Request-Id")
        if reply.status_code == 200:
            sent.request_id = sent.request_id or reply.json()["id"].removeprefix("chatcmpl-")
            sent.outcome = "answered"
        else:
            sent.outcome, sent.detail = "errored", f"HTTP {reply.status_code}: {reply.text[:120]}"

    def _send_direct(self, seq: int) -> None:
        conversation, user = self._conversation(seq)
        request = PromptRequest(conversation_id=conversation, user_id=user, tenant="faults",
                                model="smollm2-135m-instruct",
                                messages=[ChatMessage("user", self._rng.choice(QUESTIONS))],
                                sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                                reply_to=REPLY_TOPIC, reply_partition=seq % REPLY_PARTITIONS,
                                deadline_at=now_ms() + int(self.http_timeout_s * 1000))
        sent = Sent(seq, "direct", self.scenario, time.monotonic(), request_id=request.request_id)
        self.ledger.append(sent)

        def delivered(err, _msg) -> None:
            if err is not None:  # never reached the broker: the producer's outcome, not the pipeline's
                sent.outcome, sent.detail = "errored", f"produce failed: {err}"

        while True:
            try:
                self._producer.produce("chat.prompts", default_codec().encode(request),
                                       key=conversation.encode(), on_delivery=delivered)
                break
            except BufferError:
                self._producer.poll(0.1)
        self._producer.poll(0)

    # -- outcomes ----------------------------------------------------------------------------------

    def settle(self) -> None:
        """Direct requests take their outcome from the first final chunk seen at their reply address."""
        for sent in self.ledger:
            if sent.route == "direct" and sent.outcome is None:
                final = self.observer.final_of(sent.request_id)
                if final is not None:
                    answered = final.finish_reason in ANSWERED or (final.finish_reason is None and not final.error)
                    sent.outcome = "answered" if answered else "errored"
                    sent.detail = "" if answered else f"{final.error_code}: {final.error}"

    def of(self, scenario: str) -> list[Sent]:
        return [s for s in self.ledger if s.scenario == scenario]

    def wait_settled(self, scenario: str, timeout_s: float) -> list[Sent]:
        """Every request of ``scenario`` with an outcome, or ``timeout_s`` passed: the unsettled ones."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.settle()
            open_ = [s for s in self.of(scenario) if s.outcome is None]
            if not open_ or time.monotonic() > deadline:
                return open_
            time.sleep(1.0)

    def close(self) -> None:
        self.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)


def table(rows: list[dict]) -> str:
    """The per-scenario table the fault tests print (and docs/testing.md copies)."""
    columns = ["scenario", "sent", "answered", "errored", "lost", "stuck", "turns", "archived", "degraded", "restarts",
               "seconds"]
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    line = lambda values: "| " + " | ".join(str(v).ljust(widths[c]) for c, v in zip(columns, values)) + " |"
    out = [line(columns), "|" + "|".join("-" * (widths[c] + 2) for c in columns) + "|"]
    out += [line([r.get(c, "") for c in columns]) for r in rows]
    return "\n".join(out)


_ERROR_SUMMARY = re.compile(r"\s+")


def error_kinds(sent: list[Sent]) -> dict[str, int]:
    """How the errored requests ended, for the test's report (e.g. {'HTTP 503': 4, 'expired': 1})."""
    kinds: dict[str, int] = defaultdict(int)
    for s in sent:
        if s.outcome == "errored":
            kinds[_ERROR_SUMMARY.sub(" ", s.detail.split(":")[0])[:40]] += 1
    return dict(kinds)
