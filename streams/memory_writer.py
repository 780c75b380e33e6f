"""The memory writer: ``chat.turns`` -> memory (Qdrant). The durable outbox of memory's writes.

Memory is an enhancement of chat, not a step of it (the seeds: availability over strict
consistency, slightly stale context is fine). So no agent writes memory on its way: the record
agent says on each turn whether memory keeps it (ConversationTurn v4 ``remembered``) and puts the
turn on ``chat.turns``, which it does anyway; this writer, a consumer group of its own
(``<app id>.memory``) in a thread of the streams worker, embeds the kept turns and upserts them,
and commits a batch only once Qdrant has it. While Qdrant is slow or away its upserts are retried
within ``retry_budget_s`` (60 s; past it the process exits unacked with code 75 and the batch is
read again after the restart); the turns wait on the topic meanwhile: nothing is lost, memory is
late (its lag is ``chatpipe_consumer_lag_records{group="<app id>.memory"}``), and nothing else
waits: prompts are served with their recent turns (``intake.py``: recall degraded), turns are
recorded and archived.

Why a topic and not a store of our own: ``chat.turns`` is already durable and ordered per
conversation, every streams worker can take over a partition of it, and a consumer group's
committed offset is the outbox's "sent" mark. Upserts are idempotent (the point id derives from
the turn id), so a batch written again after a restart repeats the same facts.

Forgetting: a turn of a user (or conversation) forgotten before it was written is skipped (the
erasure registry, as the record and archive agents do). The forget agent deletes the subject's
points without holding a lock against this writer, so after each upsert the registry is asked
again, and the points of subjects erased meanwhile are deleted: either the deletion was registered
before that second look (the writer deletes what it wrote), or after it, and so after the upsert,
before the forget agent's own delete (which removes it). Nothing forgotten comes back.

Turns of writers before v4 read ``remembered`` False: their record agent had upserted them.
A turn that does not decode is skipped with a warning (the archive keeps it as it was on the
broker; no dead letter: the record agent produced it and it is no request of anyone).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from schemas.errors import DecodeError
from schemas.records import ConversationTurn
from schemas.topics import TURNS
from streams.erasures import ErasureRegistry
from streams.faults import Retrier
from streams.services import StreamsServices
from streams.settings import StreamsSettings
from transport.group_reader import GroupReader
from transport.message import ConsumedMessage
from transport.settings import IDLE_FETCH_WAIT_MS, KafkaSettings
from transport.spans import Span

log = logging.getLogger(__name__)

BATCH = 64  # turns per embedding call and upsert
POLL_S = 0.5  # longest an idle poll waits (a turn arriving returns it at once)


def memory_writer_group(app_id: str) -> str:
    """The writer's consumer group, next to the Faust app's (``<prefix><app id>``)."""
    return f"{app_id}.memory"


class MemoryWriter:
    def __init__(self, kafka: KafkaSettings, settings: StreamsSettings, services: StreamsServices,
                 erasures: ErasureRegistry, group_id: str, batch: int = BATCH) -> None:
        self.kafka = kafka
        self.settings = settings
        self.services = services
        self.erasures = erasures
        self.group_id = group_id
        self.batch = batch
        self.retrier = Retrier(settings.retry_budget_s, settings.retry_backoff_s, settings.retry_max_backoff_s)
        self.upserted = 0  # turns written to memory
        self.not_remembered = 0  # turns memory does not keep (failed answers, raw prompts, older writers)
        self.erased = 0  # turns of a user or conversation forgotten before (or while) they were written
        self.undecodable = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, on_failure: Callable[[BaseException], None]) -> None:
        """Write in a thread of its own; an outage past the budget or a bug goes to ``on_failure``
        (the app exits unacked: streams/faults.py)."""
        self._on_failure = on_failure
        self._thread = threading.Thread(target=self._run, name="chatpipe-memory-writer", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop after the batch in hand (written and committed) and leave the group; a batch still
        retrying an absent Qdrant after ``timeout_s`` is left uncommitted (read again at the next
        start: the writes are idempotent), so a SIGTERM is not held up for the whole retry budget."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        reader = None
        try:
            reader = GroupReader(self.kafka, group_id=self.group_id, topics=[self.kafka.topic(TURNS)],
                                 error_budget_s=self.settings.retry_budget_s, tracer=self.services.tracer,
                                 extra_config={"fetch.wait.max.ms": IDLE_FETCH_WAIT_MS})
            while not self._stop.is_set():
                messages = reader.poll_messages(self.batch, POLL_S)
                if not messages:
                    continue
                self.write(messages)
                # Synchronous: a batch is "sent" once the broker has its position; a rebalance (inside the
                # next poll) then finds nothing in hand.
                reader.commit_offsets(next_positions(messages), asynchronous=False)
        except BaseException as exc:  # noqa: BLE001 - the app decides (it exits unacked)
            if not self._stop.is_set():
                log.error("the memory writer stopped: %s: %s", type(exc).__name__, exc)
                self._on_failure(exc)
        finally:
            if reader is not None:
                reader.close()

    def write(self, messages: list[ConsumedMessage]) -> None:
        """Embed and upsert the kept turns of ``messages`` (blocking: the writer's thread)."""
        from streams.embeddings import turn_text
        from streams.memory import StoredTurn

        tracer = self.services.tracer
        stored: list[Any] = []
        spans: list[Span] = []  # "process chat.turns" of each turn written: its request's trace goes on here
        for m in messages:
            try:
                turn = self.services.codec.decode(m.value, ConversationTurn, topic=m.topic, partition=m.partition,
                                                  offset=m.offset)
            except DecodeError as exc:
                self.undecodable += 1
                log.warning("memory writer: skipping a record of chat.turns that is no turn: %s", exc)
                continue
            if not turn.remembered:
                self.not_remembered += 1
            elif self.erasures.erases_record(turn):
                self.erased += 1
            else:
                stored.append(StoredTurn(turn_id=turn.event_id, tenant=turn.tenant, user_id=turn.user_id,
                                         conversation_id=turn.conversation_id, turn_index=turn.turn_index,
                                         prompt=turn.prompt, answer=turn.answer, created_at=turn.created_at))
                spans.append(tracer.process(m.topic, m.traceparent, group=self.group_id, partition=m.partition,
                                            offset=m.offset, attributes={"chatpipe.request_id": turn.request_id}))
        if not stored:
            return
        memory = self.services.memory
        embed_ns = time.time_ns()
        vectors = self.services.embedder.encode([turn_text(t) for t in stored])
        upsert_ns = time.time_ns()
        self.retrier.call_blocking("memory upsert", self.services.in_memory_thread_blocking, memory.upsert,
                                   stored, vectors)
        done_ns, batch = time.time_ns(), {"chatpipe.batch.size": len(stored)}
        erased_meanwhile = [t for t in stored if self.erasures.erases_record(t)]  # the second look (docstring)
        if erased_meanwhile:
            self.retrier.call_blocking("memory delete", self.services.in_memory_thread_blocking,
                                       memory.delete_turns, erased_meanwhile)
            log.info("memory writer: %d turn(s) of a subject forgotten while they were written, deleted again",
                     len(erased_meanwhile))
        self.erased += len(erased_meanwhile)
        self.upserted += len(stored) - len(erased_meanwhile)
        for span in spans:
            span.child("embed", start_ns=embed_ns, attributes=batch).end(upsert_ns)
            span.child("memory upsert", start_ns=upsert_ns, attributes=batch).end(done_ns)
            span.end()


def next_positions(messages: list[ConsumedMessage]) -> dict[tuple[str, int], int]:
    """{(topic, partition): one past the highest offset of ``messages``}: what to commit."""
    positions: dict[tuple[str, int], int] = {}
    for m in messages:
        key = (m.topic, m.partition)
        positions[key] = max(positions.get(key, 0), m.offset + 1)
    return positions
