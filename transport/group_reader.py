"""A consumer-group consumer for services that finish messages out of order.

A consumer that commits everything polled suits a batch done as a whole (the tests'
``tests/transport/batch_consumer.py``). A service with many messages in flight (the inference worker) instead needs:

- rebalance hooks (``on_assign`` / ``on_revoke`` / ``on_lost``) to stop the work of partitions
  it no longer owns, with the cooperative-sticky protocol so a joining member does not revoke
  everything from everybody;
- ``pause`` / ``resume`` per partition (backpressure: the fetcher stops, memory stays bounded);
- ``commit_offsets`` of explicit positions (its own per-partition "lowest unfinished offset").

One thread owns an instance: librdkafka calls the rebalance hooks (and ``on_commit``, with the
broker's answer to each commit) from inside ``poll_messages``. Decoding is the caller's business
(raw ``ConsumedMessage``s come out).

Consumer errors are classified by ``transport.failures.classify`` (the one table of Kafka codes:
a broker away, a topic or leader moving, the group moving, share sessions, quotas are TRANSIENT;
``_PARTITION_EOF`` is no error and is dropped; anything else, e.g. authentication, a lost
position, a fatal error, raises ``TransportError``). ``ShareGroupReader`` and ``TailReader``
use the same rule.

A transient error is logged and polled through: librdkafka reconnects, refreshes metadata and
rejoins by itself. ``transport.failures.ErrorBudget`` bounds it: transient errors that keep coming (each less than
``quiet_s`` after the previous one, no message in between) for longer than ``budget_s`` raise
``TransportError`` (the infrastructure is away past the retry budget: the caller exits and is
restarted, docs/architecture.md "Failure policy").
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from transport.batches import wrap_batch
from transport.errors import TransportError
from transport.failures import ErrorBudget
from transport.message import ConsumedMessage
from transport.settings import KafkaSettings
from transport.spans import Tracer

log = logging.getLogger(__name__)

PartitionsHook = Callable[[list[tuple[str, int]]], None]
# The broker's answer to a commit: {(topic, partition): offset} confirmed, and the same of those
# that failed.
CommitHook = Callable[[dict[tuple[str, int], int], dict[tuple[str, int], int]], None]

def messages_of(raw: list, errors: ErrorBudget, where: Callable[[Any], str],
                wrap: Callable[[Any], Any] = ConsumedMessage) -> list:
    """The messages of a consumed ``raw`` batch, wrapped; its error events through ``errors.check``
    (``where(msg)`` names the place in the error), end-of-partition events dropped. Shared by the
    group, share and tail consumers."""
    out = []
    for msg in raw:
        err = msg.error()
        if err is None:
            out.append(wrap(msg))
        elif err.code() != KafkaError._PARTITION_EOF:
            errors.check(where(msg), err)
    return out


class GroupReader:
    def __init__(
        self,
        settings: KafkaSettings,
        *,
        group_id: str,
        topics: Iterable[str],
        on_assign: PartitionsHook | None = None,
        on_revoke: PartitionsHook | None = None,
        on_lost: PartitionsHook | None = None,
        on_commit: CommitHook | None = None,
        error_budget_s: float = 60.0,
        extra_config: dict[str, Any] | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.settings = settings
        self.group_id = group_id
        self.tracer = tracer or Tracer(settings.client_id)  # a "receive" span per batch (transport/spans.py)
        self._hooks = (on_assign, on_revoke, on_lost or on_revoke)
        self._on_commit = on_commit
        self.errors = ErrorBudget(error_budget_s)
        self.assignment: set[tuple[str, int]] = set()
        self._memberless_since: float | None = time.monotonic()  # not in the group yet: joining
        self._consumer = Consumer({
            **settings.client_config(),
            "group.id": group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            # A new group reads what waits from the start (docs/worker.md, "Start position").
            "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "cooperative-sticky",
            **({"on_commit": self._committed} if on_commit else {}),
            **(extra_config or {}),
        })
        self.topics = list(topics)
        self._destination = ",".join(self.topics)  # the receive span's messaging.destination.name
        self._consumer.subscribe(self.topics, on_assign=self._assigned, on_revoke=self._revoked,
                                 on_lost=lambda consumer, partitions: self._revoked(consumer, partitions, lost=True))

    # librdkafka calls these from inside poll(); with cooperative-sticky they carry only the change.
    def _assigned(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        pairs = [(tp.topic, tp.partition) for tp in partitions]
        self.assignment.update(pairs)
        if self._hooks[0]:
            self._hooks[0](pairs)

    def _revoked(self, _consumer: Consumer, partitions: list[TopicPartition], lost: bool = False) -> None:
        pairs = [(tp.topic, tp.partition) for tp in partitions]
        hook = self._hooks[2 if lost else 1]
        if hook:
            hook(pairs)
        self.assignment.difference_update(pairs)

    def _committed(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        if err is not None and err.code() == KafkaError._NO_OFFSET:
            return  # nothing was there to commit
        done, failed = {}, {}
        for tp in partitions:
            ((failed if err is not None or tp.error is not None else done))[(tp.topic, tp.partition)] = tp.offset
        if failed:
            log.warning("commit failed for %s: %s", sorted(failed), err.str() if err is not None else
                        "; ".join(tp.error.str() for tp in partitions if tp.error is not None))
        self._on_commit(done, failed)

    def poll_messages(self, max_messages: int, timeout_s: float) -> list[ConsumedMessage]:
        """Up to ``max_messages``; returns as soon as one is there (waits at most ``timeout_s``).

        ``consume(n, timeout)`` alone waits for n messages or the whole timeout: a lone
        request would sit ``timeout_s`` in the client before anyone sees it.
        """
        start_ns = time.time_ns()
        raw = self._consumer.consume(max(1, max_messages), 0)
        if not raw and timeout_s > 0:
            raw = self._consumer.consume(1, timeout_s)
            start_ns = time.time_ns()  # the receive span starts when a record came, not with the wait
            if raw and max_messages > 1:
                raw += self._consumer.consume(max_messages - 1, 0)
        if raw:
            self.tracer.record_receive(self._destination, self.group_id, raw, start_ns)
        self._check_membership()
        out = wrap_batch(raw)  # the common case (no error events), built in a GC pause (transport/batches.py)
        if out is None:
            out = messages_of(raw, self.errors, lambda msg: f"consumer error on {msg.topic() or self.topics}")
        if out:
            self.errors.ok()
        return out

    def _check_membership(self) -> None:
        """Raise ``TransportError`` when this consumer has not been a member of its group for longer than
        the error budget: it reads nothing and says nothing. Seen once in CI after a broker restart: the
        worker's interactive consumer was revoked with the session and never joined again (its group EMPTY,
        9 prompts waiting) while the same process's batch consumer rejoined in 9 s. The caller exits and is
        restarted, as for any infrastructure fault past its budget (docs/architecture.md, "Failure policy")."""
        now = time.monotonic()
        if self._consumer.memberid():
            self._memberless_since = None
        elif self._memberless_since is None:
            self._memberless_since = now
        elif now - self._memberless_since > self.errors.budget_s:
            raise TransportError(f"consumer of {self.topics} has not been a member of group {self.group_id!r} for "
                                 f"{now - self._memberless_since:.0f} s (it never rejoined after losing its session)")

    def pause(self, partitions: Iterable[tuple[str, int]]) -> None:
        if tps := [TopicPartition(t, p) for t, p in partitions]:
            self._consumer.pause(tps)

    def resume(self, partitions: Iterable[tuple[str, int]]) -> None:
        if tps := [TopicPartition(t, p) for t, p in partitions]:
            self._consumer.resume(tps)

    def seek(self, topic: str, partition: int, offset: int) -> None:
        """Read ``topic[partition]`` from ``offset`` next: what was prefetched of it is dropped and
        fetched again (a paused partition too: librdkafka keeps handing out prefetched records of a
        partition after ``pause``)."""
        self._consumer.seek(TopicPartition(topic, partition, offset))

    def commit_offsets(self, offsets: dict[tuple[str, int], int], *, asynchronous: bool = True,
                       metadata: dict[tuple[str, int], str] | None = None) -> None:
        """Commit ``{(topic, partition): next offset to read}``, each with its ``metadata`` string (the
        broker keeps it with the offset; a commit without one stores ""). Asynchronous: the broker's
        answer comes to ``on_commit`` inside a later poll. Synchronous: returns once every partition
        is committed, else raises ``TransportError``."""
        if not offsets:
            return
        metadata = metadata or {}
        tps = [TopicPartition(t, p, off, **({"metadata": m} if (m := metadata.get((t, p))) else {}))
               for (t, p), off in offsets.items()]
        try:
            result = self._consumer.commit(offsets=tps, asynchronous=asynchronous)
        except KafkaException as exc:
            raise TransportError(f"commit of {offsets} failed: {exc}") from exc
        failed = [tp for tp in (result or []) if tp.error is not None]
        if failed:
            raise TransportError("commit failed for " + ", ".join(
                f"{tp.topic}[{tp.partition}]@{tp.offset}: {tp.error.str()}" for tp in failed))

    def committed_metadata(self, partition: tuple[str, int], timeout_s: float = 10.0) -> str:
        """The metadata string stored with ``partition``'s committed offset ("" when none); asks the
        group's coordinator (a round trip). Raises ``TransportError`` when it cannot answer."""
        try:
            [tp] = self._consumer.committed([TopicPartition(*partition)], timeout=timeout_s)
        except KafkaException as exc:
            raise TransportError(f"reading the committed offset of {partition} failed: {exc}") from exc
        if tp.error is not None:
            raise TransportError(f"reading the committed offset of {partition} failed: {tp.error.str()}")
        return tp.metadata or ""

    def close(self, revoke_timeout_s: float = 10.0) -> None:
        """Leave the group (partitions move at once instead of after the session timeout).

        Unsubscribes and serves the revocation first, then closes with nothing assigned: a rebalance
        that arrives while ``Consumer.close`` runs has librdkafka call the rebalance hook from inside
        close, whose assign then waits forever on a queue only close would serve (a worker stuck on
        exit under load, caught by ``tests/worker/test_worker_failures.py``; librdkafka #4527 is the
        same family). Records a poll returns meanwhile are dropped: uncommitted, so redelivered."""
        try:
            self._consumer.unsubscribe()
            deadline = time.monotonic() + revoke_timeout_s
            while self._consumer.assignment() and time.monotonic() < deadline:
                self._consumer.consume(1, 0.1)
        except KafkaException as exc:  # a consumer in a fatal state: close is all that is left to do
            log.debug("unsubscribe before close failed: %s", exc)
        self._consumer.close()
