"""Two streams workers and two inference workers on the three-broker cluster, one streams worker
SIGKILLed mid-load: every turn once, in order, each prompt's recent turns complete, memory recall
working after the rebalance.

Everything is a real process started the way a user starts it (``chatpipe up --brokers 3
--streams-workers 2 --inference-workers 2`` with memory in a real Qdrant server); conversations come
three ways: through the gateway (HTTP), and produced straight to ``chat.prompts`` with the Python
example's partitioning (librdkafka ``murmur2_random``) and with the Java client's (the partition the
real kafka-clients jar computes for the key, ``tests/java_partitions.py``). Each conversation sends
its next prompt once the previous turn is on ``chat.turns``, so the next context must hold it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Callable

import httpx
import pytest

from chatpipe.testing.ports import free_port, free_port_block
from chatpipe.testing.qdrant import QDRANT_TOOL, SKIP_REASON, QdrantPeer
from infra.services import alive
from schemas.codec import default_codec
from schemas.records import (ChatMessage, ConversationTurn, InferenceRequest, MemoryScope, PromptRequest,
                             SamplingParams, now_ms)
from tests.faults.stack import SERVICE_ENV
from tests.java_partitions import partitions_of
from transport.partitioning import LIBRDKAFKA_PARTITIONER

# Two streams workers share one memory: a Qdrant server (local mode is one process's), absent in a
# clone without ../shared/tools/qdrant.
pytestmark = [pytest.mark.integration, pytest.mark.skipif(not QDRANT_TOOL.exists(), reason=SKIP_REASON)]
REPO = Path(__file__).resolve().parents[2]
TURNS = 5  # per conversation; within the streams tier's recent window (8), so every earlier turn is in context
MAX_TOKENS = 4
MODEL = "smollm2-135m-instruct"
ROUTES = ("gateway", "python", "java")
FACT = "My locker code is 4512."


def chatpipe(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chatpipe.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


class Observer:
    """Reads ``chat.turns`` and ``chat.inference.requests`` from the start, by request id."""

    def __init__(self, bootstrap: str, story: Callable[[], str] = lambda: "") -> None:
        from confluent_kafka import Consumer

        self.story = story  # what the stack did, said when a turn does not come

        self.turns: dict[str, list[ConversationTurn]] = defaultdict(list)
        self.requests: dict[str, list[InferenceRequest]] = defaultdict(list)
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"scale-out-{uuid.uuid4().hex[:6]}",
                                   "auto.offset.reset": "earliest", "enable.auto.commit": False})
        self._consumer.subscribe(["chat.turns", "chat.inference.requests"])
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        codec = default_codec()
        while not self._stop.is_set():
            for msg in self._consumer.consume(500, 0.3):
                if msg.error() is None and msg.value() is not None:
                    record = codec.decode(msg.value())
                    with self.lock:
                        if isinstance(record, ConversationTurn):
                            self.turns[record.request_id].append(record)
                        elif isinstance(record, InferenceRequest):
                            self.requests[record.request_id].append(record)

    def wait_turn(self, request_id: str, timeout_s: float = 240) -> ConversationTurn:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if self.turns.get(request_id):
                    return self.turns[request_id][0]
            time.sleep(0.2)
        raise AssertionError(f"no turn for request {request_id} within {timeout_s} s\n{self.story()}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._consumer.close()


class Conversations:
    """One thread per conversation: prompt k is sent once turn k-1 is recorded."""

    def __init__(self, gateway_url: str, api_key: str, bootstrap: str, observer: Observer, java_partitions) -> None:
        from confluent_kafka import Producer

        self.gateway_url, self.api_key, self.observer = gateway_url, api_key, observer
        self.java_partitions = java_partitions
        # the Python example's producer settings (examples/python/produce_prompt.py)
        self.producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                                  "partitioner": LIBRDKAFKA_PARTITIONER})
        self.sent: dict[str, list[tuple[str, str]]] = defaultdict(list)  # conversation -> [(request id, prompt)]
        self.errors: list[str] = []
        self.progress: dict[str, int] = defaultdict(int)  # conversation -> turns recorded

    def run(self, route: str, conversation: str, user: str, turns: range, stop_after: threading.Event | None = None,
            pause: threading.Event | None = None) -> None:
        try:
            for k in turns:
                if pause is not None:
                    pause.wait()
                prompt = f"Note {k} of {conversation}: remember the number {k * 7}."
                request_id = self.send(route, conversation, user, prompt)
                self.sent[conversation].append((request_id, prompt))
                self.observer.wait_turn(request_id)
                self.progress[conversation] += 1
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(f"{conversation}: {type(exc).__name__}: {exc}")

    def send(self, route: str, conversation: str, user: str, prompt: str,
             scope: MemoryScope = MemoryScope.CONVERSATION) -> str:
        if route == "gateway":
            reply = httpx.post(f"{self.gateway_url}/v1/chat/completions", timeout=240,
                               headers={"Authorization": f"Bearer {self.api_key}",
                                        "X-Chatpipe-Conversation-Id": conversation},
                               json={"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
                                     "messages": [{"role": "user", "content": prompt}]})
            assert reply.status_code == 200, reply.text
            return reply.headers["X-Chatpipe-Request-Id"]
        request = PromptRequest(conversation_id=conversation, user_id=user, tenant="scale", model=MODEL,
                                messages=[ChatMessage("user", prompt)], memory_scope=scope,
                                sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                                reply_to="chat.replies", reply_partition=0, deadline_at=now_ms() + 240_000)
        extra = {"partition": self.java_partitions[conversation]} if route == "java" else {}
        self.producer.produce("chat.prompts", default_codec().encode(request), key=conversation.encode(), **extra)
        self.producer.flush(30)
        return request.request_id


@pytest.fixture(scope="module")
def scaled_stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale-out")
    state = root / "state"
    qdrant = QdrantPeer(root, "qdrant")
    qdrant.start()
    qdrant.wait_ready()
    client_ports = [free_port() for _ in range(3)]
    env = {**os.environ, **SERVICE_ENV, "CHATPIPE_STATE_DIR": str(state), "COLUMNS": "250",
           "CHATPIPE_CLIENT_PORTS": json.dumps(client_ports),
           "CHATPIPE_CONTROLLER_PORTS": json.dumps([free_port() for _ in range(3)])}
    gateway_port = free_port()
    try:
        up = chatpipe("up", "--brokers", "3", "--streams-workers", "2", "--inference-workers", "2",
                      "--qdrant-url", qdrant.url, "--gateway-port", str(gateway_port),
                      "--worker-metrics-port", str(free_port_block(2)), "--streams-metrics-port", str(free_port_block(2)),
                      "--redis-port", str(free_port()), env=env, timeout=900)
        assert up.returncode == 0, up.stdout + up.stderr
        yield {"env": env, "state": state, "bootstrap": ",".join(f"127.0.0.1:{p}" for p in client_ports),
               "gateway_url": f"http://127.0.0.1:{gateway_port}",
               "api_key": next(iter(json.loads((state / "gateway" / "keys.json").read_text())))}
    finally:
        chatpipe("down", env=env, timeout=300)
        qdrant.stop()


def service_pid(state: Path, name: str) -> int | None:
    try:
        pid = int((state / "run" / f"{name}.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if alive(pid) else None


def stack_story(state: Path, lines: int = 40) -> str:
    """What the supervisor did and what the streams workers warned of: said when a turn does not come."""
    logs = state / "logs"
    story = [f"supervisor.log:\n{(logs / 'supervisor.log').read_text()[-4000:]}"]
    for log in sorted(logs.glob("streams*.log")):
        warned = [line for line in log.read_text(errors="replace").splitlines()
                  if "[WARNING]" in line or "[ERROR]" in line or "[CRITICAL]" in line or "Worker ready" in line]
        story.append(f"{log.name} (warnings, errors, readiness):\n" + "\n".join(warned[-lines:]))
    return "\n".join(story)


def test_two_streams_workers_stay_exact_through_a_sigkill(scaled_stack, java_partitions):
    bootstrap = scaled_stack["bootstrap"]
    convs = {route: [f"so-{route}-{i}-{uuid.uuid4().hex[:6]}" for i in range(2)] for route in ROUTES}
    java_placed = dict(zip(convs["java"], partitions_of(java_partitions, convs["java"], 6)))
    observer = Observer(bootstrap, story=lambda: stack_story(scaled_stack["state"]))
    talk = Conversations(scaled_stack["gateway_url"], scaled_stack["api_key"], bootstrap, observer, java_placed)
    try:
        # memory: a fact told before the kill, recalled from another conversation of the user after it
        fact_id = talk.send("python", "so-mem-1", "mem-user", FACT, MemoryScope.USER)
        observer.wait_turn(fact_id)

        threads = [threading.Thread(target=talk.run, args=(route, conv, f"user-{conv}", range(TURNS)), daemon=True)
                   for route in ROUTES for conv in convs[route]]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 300
        while min(talk.progress[c] for cs in convs.values() for c in cs) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not talk.errors, f"before the kill: {talk.errors}\n{stack_story(scaled_stack['state'])}"
        victim = service_pid(scaled_stack["state"], "streams-2")
        assert victim is not None, "streams-2 is not running"
        os.kill(victim, signal.SIGKILL)  # mid-load: prompts and responses of its partitions in flight
        for t in threads:
            t.join(600)
        assert not talk.errors, f"{talk.errors}\n{stack_story(scaled_stack['state'])}"
        restarted = service_pid(scaled_stack["state"], "streams-2")
        assert restarted is not None and restarted != victim, "the supervisor did not restart streams-2"

        recall_id = talk.send("python", "so-mem-2", "mem-user", "What is my locker code?", MemoryScope.USER)
        observer.wait_turn(recall_id)
        time.sleep(1.0)  # the last requests' copies reach the observer
        with observer.lock:
            turns = {rid: list(ts) for rid, ts in observer.turns.items()}
            requests = {rid: list(rs) for rid, rs in observer.requests.items()}
    finally:
        observer.close()

    fact_turn = turns[fact_id][0]
    assert fact_turn.event_id in requests[recall_id][0].recalled_turn_ids, \
        "memory recall must work after the rebalance (the fact told in another conversation)"
    for conv, sent in talk.sent.items():
        assert len(sent) == TURNS, (conv, sent)
        for k, (request_id, prompt) in enumerate(sent):
            assert len({t.event_id for t in turns[request_id]}) == 1, f"{conv} turn {k} recorded as 2 turns"
            assert turns[request_id][0].turn_index == k, (conv, k, [t.turn_index for t in turns[request_id]])
            # every earlier turn of the conversation is in this prompt's context, in order, once (in
            # every copy: a prompt read again after the kill is assembled again unless answered already)
            for copy in requests[request_id]:
                users = [m.content for m in copy.messages if m.role == "user"]
                assert users == [p for _, p in sent[:k + 1]], f"{conv} prompt {k}: context {users}"
