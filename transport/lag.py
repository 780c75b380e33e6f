"""Consumer lag of a group, in records and in seconds, for consumer groups and share groups.

Records: what the group has not done yet on each partition of its topics. A consumer group's
position is its committed offset (the earliest retained one where it never committed, where an
``auto.offset.reset=earliest`` member starts), so its lag is ``end - committed``: with the
project's commit-after-the-effect, requests still being served count. A share group has no
committed offset; the broker keeps, per partition, a start offset (SPSO: everything below it is
acknowledged) and, since KIP-1226 (Kafka 4.2), the count of records from there to the end not
yet acknowledged, which is its lag (``share_offsets.py`` asks for both: confluent-kafka 2.16 has
no share group admin call). Without the broker's count: ``end - SPSO``.

Seconds: now minus the timestamp of the oldest record not yet done (the producer's CreateTime,
so hosts keep NTP time), 0 when nothing waits. A consumer group's oldest is the record at its
committed offset. A share group acknowledges out of order and its SPSO moves late (seen on Kafka
4.4: SPSO 0 with 6 of 10 records accepted), so its oldest is taken as the record at ``end -
lag``: exact when records are done in the order they came (the queue case), a lower bound
otherwise. Reading that record costs a fetch per lagging partition, so ``LagMonitor`` measures
every ``interval_s`` (5 s) in a thread of its own and the metrics show the last measurement.

A group's lag is the group's, not one member's: every member reports the same value (aggregate
with ``max``, not ``sum``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Literal

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import OffsetSpec

from transport.admin import TopicAdmin
from transport.errors import TransportError
from transport.settings import KafkaSettings
from transport.share_offsets import ShareOffsetsUnsupported, share_group_offsets

log = logging.getLogger(__name__)
_client_log = logging.getLogger("transport.librdkafka")

TP = tuple[str, int]


@dataclass(frozen=True, slots=True)
class GroupTopics:
    """What to measure: ``group`` (of ``kind``) on ``topics`` (full names, prefix included)."""

    group: str
    topics: tuple[str, ...]
    kind: Literal["consumer", "share"] = "consumer"


@dataclass(frozen=True, slots=True)
class TopicLag:
    group: str
    topic: str
    records: int | None  # None: not known (the broker could not be asked)
    seconds: float | None  # age of the oldest record not done; 0: none waits; None: not known


class LagReader:
    """Measures lag once per ``read`` (blocking: a few admin requests and one fetch). One thread."""

    def __init__(self, kafka: KafkaSettings, timeout_s: float = 5.0) -> None:
        self.kafka = kafka
        self.timeout_s = timeout_s
        config = {**kafka.client_config(), "logger": _client_log}
        self._admin = TopicAdmin(kafka, timeout_s)  # the topics' partitions and offsets
        # Committed offsets are asked through a consumer of the group that never joins it (not the
        # admin client's ListConsumerGroupOffsets: a NULL dereference in librdkafka 2.x on
        # NOT_COORDINATOR, see TopicAdmin.committed). One per group, kept.
        self._offsets: dict[str, Consumer] = {}
        self._config = config
        # Reads the oldest waiting record of each lagging partition: assign at that offset, take one
        # record, unassign. A group id of its own, never joined, never committed.
        self._reader = Consumer({**config, "group.id": "chatpipe-lag-reader", "enable.auto.commit": False,
                                 "enable.auto.offset.store": False, "auto.offset.reset": "earliest",
                                 "fetch.max.bytes": 1 << 20, "max.partition.fetch.bytes": 1 << 16})
        self._unsupported_logged: set[str] = set()

    def read(self, groups: Iterable[GroupTopics], now_ms: int | None = None) -> list[TopicLag]:
        groups = list(groups)
        topics = {t for g in groups for t in g.topics}
        partitions = {t: n for t, n in self._admin.topic_partitions().items() if t in topics}
        every = [(t, p) for t in sorted(partitions) for p in range(partitions[t])]
        ends = self._admin.offsets(every, OffsetSpec.latest())
        firsts = self._admin.offsets(every, OffsetSpec.earliest())
        oldest: dict[tuple[str, str], dict[TP, int]] = {}  # (group, topic) -> partition -> offset of its oldest
        waiting: dict[tuple[str, str], int | None] = {}
        for g in groups:
            tps = [(t, p) for t in g.topics if t in partitions for p in range(partitions[t])]
            try:
                pending = self._consumer_pending(g.group, tps, ends, firsts) if g.kind == "consumer" else \
                    self._share_pending(g.group, tps, ends, firsts)
            except ShareOffsetsUnsupported as exc:
                if g.group not in self._unsupported_logged:
                    self._unsupported_logged.add(g.group)
                    log.warning("lag of share group %s not known: %s", g.group, exc)
                pending = None
            except TransportError as exc:  # this group's offsets could not be read now: not known
                log.warning("lag of group %s not measured: %s", g.group, exc)
                pending = None
            for topic in g.topics:
                key = (g.group, topic)
                if pending is None:
                    waiting[key] = None
                    continue
                mine = {tp: v for tp, v in pending.items() if tp[0] == topic}
                waiting[key] = sum(n for n, _ in mine.values())
                oldest[key] = {tp: offset for tp, (n, offset) in mine.items() if n > 0}
        stamps = self._timestamps({tp: o for per in oldest.values() for tp, o in per.items()})
        now = time.time() * 1000 if now_ms is None else now_ms
        out = []
        for (group, topic), records in waiting.items():
            seconds: float | None = None
            if records is not None:
                offsets = oldest.get((group, topic), {})
                ages = [max(0.0, (now - stamps[(tp, o)]) / 1000) for tp, o in offsets.items() if (tp, o) in stamps]
                seconds = max(ages) if ages else (0.0 if not offsets else None)
            out.append(TopicLag(group, topic, records, seconds))
        return out

    # -- positions ------------------------------------------------------------------------------

    def _consumer_pending(self, group: str, tps: list[TP], ends: dict[TP, int],
                          firsts: dict[TP, int]) -> dict[TP, tuple[int, int]]:
        """partition -> (records waiting, offset of the oldest) of consumer group ``group``."""
        committed = self._committed(group, tps)
        out = {}
        for tp in tps:
            position = max(committed.get(tp, -1), firsts[tp])  # none committed, or retention moved past it
            out[tp] = (max(0, ends[tp] - position), position)
        return out

    def _share_pending(self, group: str, tps: list[TP], ends: dict[TP, int],
                       firsts: dict[TP, int]) -> dict[TP, tuple[int, int]]:
        """The same for share group ``group``: the broker's lag, the oldest at ``end - lag``. A
        partition without share state yet (never fetched by the group) counts from its first offset
        (the worker sets ``share.auto.offset.reset=earliest``)."""
        by_topic: dict[str, list[int]] = {}
        for t, p in tps:
            by_topic.setdefault(t, []).append(p)
        known = {(o.topic, o.partition): o for o in share_group_offsets(self.kafka, group, by_topic, self.timeout_s)}
        out = {}
        for tp in tps:
            o = known.get(tp)
            start = firsts[tp] if o is None or o.start_offset < 0 else max(o.start_offset, firsts[tp])
            n = max(0, ends[tp] - start) if o is None or o.lag is None else min(o.lag, max(0, ends[tp] - start))
            out[tp] = (n, max(start, ends[tp] - n))
        return out

    def _committed(self, group: str, tps: list[TP]) -> dict[TP, int]:
        if not tps:
            return {}
        consumer = self._offsets.get(group)
        if consumer is None:
            consumer = self._offsets[group] = Consumer({**self._config, "group.id": group,
                                                        "enable.auto.commit": False})
        try:
            found = consumer.committed([TopicPartition(t, p) for t, p in tps], timeout=self.timeout_s)
        except KafkaException as exc:
            raise TransportError(f"committed offsets of group {group}: {exc}") from exc
        return {(tp.topic, tp.partition): tp.offset for tp in found}

    # -- timestamps -----------------------------------------------------------------------------

    def _timestamps(self, wanted: dict[TP, int]) -> dict[tuple[TP, int], float]:
        """(partition, offset) -> the timestamp (epoch ms) of the record at that offset (or the first
        one after it: a compacted or aborted offset holds none). Those not read within the timeout
        are left out."""
        if not wanted:
            return {}
        self._reader.assign([TopicPartition(t, p, o) for (t, p), o in wanted.items()])
        found: dict[tuple[TP, int], float] = {}
        deadline = time.monotonic() + self.timeout_s
        try:
            while len(found) < len(wanted) and time.monotonic() < deadline:
                for msg in self._reader.consume(len(wanted), timeout=min(0.5, max(0.01, deadline - time.monotonic()))):
                    tp = (msg.topic(), msg.partition())
                    if msg.error() is not None or tp not in wanted or (tp, wanted[tp]) in found:
                        continue
                    if msg.offset() >= wanted[tp]:
                        found[(tp, wanted[tp])] = float(msg.timestamp()[1])
        finally:
            self._reader.unassign()  # no fetching in the background between measurements
        return found

    def close(self) -> None:
        for consumer in (*self._offsets.values(), self._reader):
            try:
                consumer.close()
            except RuntimeError:  # closed already
                pass


class LagMonitor:
    """``LagReader.read`` every ``interval_s`` in a daemon thread, handing each measurement to
    ``on_update``. A measurement that fails (the broker away) is logged and reported as not known
    (records and seconds None): the lag of a service is a metric, never a reason to stop it."""

    def __init__(self, kafka: KafkaSettings, groups: Iterable[GroupTopics], on_update: Callable[[list[TopicLag]], None],
                 interval_s: float = 5.0, timeout_s: float = 5.0) -> None:
        self.kafka = kafka
        self.groups = list(groups)
        self.on_update = on_update
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.latest: list[TopicLag] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lag-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        reader = None
        failing = False
        while not self._stop.is_set():
            try:
                if reader is None:
                    reader = LagReader(self.kafka, self.timeout_s)
                self.latest = reader.read(self.groups)
                failing = False
            except Exception as exc:  # noqa: BLE001 - see the class docstring
                if not failing:
                    log.warning("consumer lag not measured: %s: %s", type(exc).__name__, exc)
                failing = True
                self.latest = [TopicLag(g.group, t, None, None) for g in self.groups for t in g.topics]
            try:
                self.on_update(self.latest)
            except Exception:  # a metrics callback must not end the thread
                log.exception("lag callback failed")
            self._stop.wait(self.interval_s)
        if reader is not None:
            reader.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s * 3)
