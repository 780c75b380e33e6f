"""What an agent's logic is handed and what it hands back: no Faust here.

Each agent (``intake.py``, ``record.py``, ``forget.py``, ``archive.py``, ``embedding_requests.py``) is a
class whose ``handle(messages, outbox)`` decides what to do with one batch of consumed records:
decode, validate, assemble, write state, and send its outputs and dead letters through the outbox.
It declares how it wants its batches (``batching``). ``streams/faust_runtime/`` runs it on Faust:
takes the batches, hands over the messages, delivers the outbox and acks the batch only after that
(``faust_runtime.agents.faust_agent``). A test hands it plain messages and a fake outbox instead
(tests/streams/test_agent_logic.py).

The conversation table an agent reads and writes is a ``MutableMapping`` (the Faust table in the
worker, a ``dict`` in a test); memory, the embedder and the token counter come in ``StreamsServices``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence


class Message(Protocol):
    """One consumed Kafka record, undecoded (a Faust event's ``message``; ``transport.message`` has the
    same attributes for confluent-kafka's). ``timestamp`` is in seconds, as Faust gives it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Any  # (key, value) pairs, or a mapping (Faust may hand either)
    timestamp: float


class Outbox(Protocol):
    """Where an agent's records go. The runtime delivers everything sent before it acks the batch; an
    agent that must know its records are on the broker (to end their spans) awaits ``deliver`` itself."""

    async def send(self, topic: Any, *, key: bytes | None, value: bytes, headers: list | None = None,
                   partition: int | None = None, parent_trace: str | None = None) -> None: ...

    async def deliver(self) -> None: ...


@dataclass(frozen=True)
class BatchRule:
    """How an agent wants its batches: up to ``max_events``, closed ``within_s`` after the first at the
    latest, and with ``idle_s`` as soon as none more came within it (None: Faust's timer alone)."""

    max_events: int
    within_s: float
    idle_s: float | None = None


class Agent(Protocol):
    batching: BatchRule

    async def handle(self, messages: Sequence[Message], outbox: Outbox) -> None: ...
