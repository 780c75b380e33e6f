"""The streams tier's version agent: per-version stats from ``chat.turns`` and ``chat.feedback``, published
to ``chat.models.stats`` and ``/metrics``, and the canaries' rollout rules applied to them.

A thread of the streams worker (like the memory writer), with a consumer of its own that joins no group:
at start it reads both topics from the time the oldest CANARY with a rule went into canary (the broker's
offsets for that time) and counts again, so it keeps no state of its own (a restart counts the same turns
once more from the log, never twice into one snapshot) and every streams worker computes the same figures.
Every ``interval_s`` it publishes the stats that changed (``VersionStats``, compacted: the latest per
model), sets the Prometheus gauges, and applies each CANARY's rule (``version_stats.decide``): a decision
is a whole new ``ModelVersion`` record (``transport.model_registry.promote / rollback``), which the
workers, gateways and intake follow. Several streams workers may decide the same thing at once: the
second record finds the version no longer CANARY and is not written (``TransitionError``).

A record that does not decode is skipped with a warning (the archive keeps it; no request of anyone).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from confluent_kafka import OFFSET_END, TopicPartition

from schemas.errors import DecodeError
from schemas.models import model_key
from schemas.records import ConversationTurn, Feedback, ModelState, VersionStats, now_ms
from schemas.topics import FEEDBACK, MODEL_STATS, TURNS
from streams.version_stats import VersionLedger, compared_with, decide, thumbs_up_rate
from transport import clients
from transport.model_catalog import ModelCatalog
from transport.errors import TransportError
from transport.model_registry import TransitionError, promote, publish_model_version, rollback
from transport.settings import IDLE_FETCH_WAIT_MS, KafkaSettings

log = logging.getLogger(__name__)

RULES = {"promote": promote, "rollback": rollback}


class VersionAgent:
    def __init__(self, kafka: KafkaSettings, codec: Any, catalog: ModelCatalog, metrics: Any = None,
                 interval_s: float = 10.0) -> None:  # fmt: skip
        self.kafka, self.codec, self.catalog = kafka, codec, catalog
        self.metrics = metrics  # StreamsMetrics: the per-version gauges; None: none
        self.interval_s = interval_s
        self.ledger = VersionLedger(since=now_ms())
        self.decisions: list[tuple[str, str, str]] = []  # (version, action, reason), as taken
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, on_failure: Callable[[BaseException], None]) -> None:
        canaries = [v.updated_at for v in self.catalog.versions() if v.state is ModelState.CANARY and v.rule_min_rated]
        self.ledger = VersionLedger(since=min(canaries, default=now_ms()))
        self._consumer = clients.consumer(self.kafka, "chatpipe-version-agent", {
            "enable.auto.commit": False, "enable.partition.eof": False, "fetch.wait.max.ms": IDLE_FETCH_WAIT_MS})
        self._consumer.assign(self._start_offsets(self.ledger.since))
        self._producer = clients.producer(self.kafka, {"acks": "all", "linger.ms": 50})
        self._on_failure = on_failure
        self._thread = threading.Thread(target=self._run, name="chatpipe-version-agent", daemon=True)
        self._thread.start()
        log.info("version agent: counting turns and feedback from %s", time.strftime(
            "%Y-%m-%d %H:%M:%S", time.gmtime(self.ledger.since / 1000)))

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _start_offsets(self, since_ms: int) -> list[TopicPartition]:
        topics = [self.kafka.topic(TURNS), self.kafka.topic(FEEDBACK)]
        meta = self._consumer.list_topics(timeout=10)
        missing = [t for t in topics if t not in meta.topics or not meta.topics[t].partitions]
        if missing:
            raise TransportError(f"the version agent cannot read {', '.join(missing)}: no such topic "
                                 "(`chatpipe topics apply` makes the catalog's topics)")
        wanted = [TopicPartition(t, p, since_ms) for t in topics for p in meta.topics[t].partitions]
        found = self._consumer.offsets_for_times(wanted, timeout=10)
        return [TopicPartition(tp.topic, tp.partition, tp.offset if tp.offset >= 0 else OFFSET_END) for tp in found]

    def _run(self) -> None:
        turns, feedback = self.kafka.topic(TURNS), self.kafka.topic(FEEDBACK)
        next_flush = time.monotonic() + self.interval_s
        try:
            while not self._stop.is_set():
                for message in self._consumer.consume(500, 0.2):
                    if message.error() is not None:
                        continue
                    self._take(message, turns, feedback)
                if time.monotonic() >= next_flush:
                    self.flush()
                    next_flush = time.monotonic() + self.interval_s
            self.flush()
        except BaseException as exc:  # noqa: BLE001 - the streams worker exits unacked (its supervisor restarts it)
            self._on_failure(exc)
        finally:
            self._consumer.close()
            self._producer.flush(10)

    def _take(self, message: Any, turns: str, feedback: str) -> None:
        kind = ConversationTurn if message.topic() == turns else Feedback
        try:
            record = self.codec.decode(message.value(), kind)
        except DecodeError as exc:
            log.warning("version agent: a record of %s[%d]@%d does not decode (%s); skipped", message.topic(),
                        message.partition(), message.offset(), exc)
            return
        if kind is ConversationTurn:
            self.ledger.add_turn(record)
        else:
            self.ledger.add_feedback(record)

    def flush(self) -> None:
        """Publish what changed, set the gauges, apply the canaries' rules."""
        topic = self.kafka.topic(MODEL_STATS)
        for stats in self.ledger.take_changed():
            stats.updated_at = now_ms()
            self._producer.produce(topic, self.codec.encode(stats), stats.model.encode())
            if self.metrics is not None:
                self.metrics.version_stats(stats)
        self._producer.flush(30)
        self._apply_rules()

    def _apply_rules(self) -> None:
        versions = self.catalog.versions()
        for canary in versions:
            if canary.state is not ModelState.CANARY or canary.rule_min_rated <= 0:
                continue
            ref = model_key(canary.name, canary.version)
            baseline = self.ledger.of(compared_with(canary, versions))
            decision = decide(canary, self.ledger.of(ref), baseline)
            if decision.action is None:
                continue
            try:
                records = RULES[decision.action]({model_key(v.name, v.version): v for v in versions}, ref,
                                                 decision.reason)
            except TransitionError as exc:  # another streams worker decided first
                log.info("version agent: %s: %s", ref, exc)
                continue
            for record in records:
                publish_model_version(self.kafka, record)
                self.catalog.apply(record)  # decided: not again before the listener brings it back
            self.decisions.append((ref, decision.action, decision.reason))
            log.warning("version agent: %s %s: %s", decision.action, ref, decision.reason)


def describe(stats: VersionStats) -> dict[str, float]:
    """The rates of one version's stats (the gauges, `chatpipe model stats`)."""
    return {
        "turns": stats.turns, "rated": stats.rated, "thumbs_up_rate": thumbs_up_rate(stats),
        "error_rate": stats.errors / stats.turns if stats.turns else 0.0,
        "regenerate_rate": stats.regenerations / stats.turns if stats.turns else 0.0,
        "edit_rate": stats.edits / stats.turns if stats.turns else 0.0,
        "ttft_s": stats.ttft_ms_sum / stats.turns / 1000 if stats.turns else 0.0,
        "tokens_per_s": stats.tokens_out / (stats.decode_ms_sum / 1000) if stats.decode_ms_sum else 0.0,
    }
