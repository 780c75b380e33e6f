"""A keyed record stream for durability tests: who was acknowledged, what is on the topic.

``KeyedStream`` writes ``key -> seq`` records continuously from a thread (idempotent, acks=all)
and keeps every delivery report; ``GroupReader`` is a consumer group reading throughout;
``read_topic`` reads a topic back from its start; ``verify`` compares the three.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

_quiet = logging.getLogger("tests.cluster.rdkafka")  # librdkafka's "connection refused" lines
_quiet.addHandler(logging.NullHandler())
_quiet.propagate = False


class KeyedStream:
    """Writes ``keys`` keys round-robin at ``rate`` records/s; each key's values count 0, 1, 2, ..."""

    def __init__(self, bootstrap: str, topic: str, *, keys: int = 48, rate: float = 150.0,
                 delivery_timeout_ms: int = 60_000, request_timeout_ms: int = 10_000) -> None:
        self.topic = topic
        self.keys = [f"k{i:02d}" for i in range(keys)]
        self.rate = rate
        self.producer = Producer({
            "bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
            "linger.ms": 5, "message.timeout.ms": delivery_timeout_ms,
            "request.timeout.ms": request_timeout_ms, "logger": _quiet,
            "on_delivery": self._delivered,
        })
        self.sent = 0
        self.acked: dict[tuple[str, int], tuple[int, int]] = {}  # (key, seq) -> (partition, offset)
        self.ack_times: list[float] = []
        self.last_ack_at: dict[int, float] = {}  # partition -> when its latest acknowledgement came
        self.failed: list[tuple[str, int, str]] = []  # (key, seq, error)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="keyed-stream", daemon=True)

    def _delivered(self, err, msg) -> None:
        key, seq = msg.key().decode(), int(msg.value())
        if err is None:
            offset = msg.offset()  # None or negative: acknowledged without an offset (see verify)
            self.acked[(key, seq)] = (msg.partition(), -1 if offset is None else offset)
            self.ack_times.append(now := time.monotonic())
            self.last_ack_at[msg.partition()] = now
        else:
            self.failed.append((key, seq, f"{err.name()}: {err.str()}"))

    def _run(self) -> None:
        next_seq = Counter()
        while not self._stop.is_set():
            key = self.keys[self.sent % len(self.keys)]
            while True:
                try:
                    self.producer.produce(self.topic, str(next_seq[key]).encode(), key.encode())
                    break
                except BufferError:
                    self.producer.poll(0.05)
            next_seq[key] += 1
            self.sent += 1
            self.producer.poll(0)
            # Pace against the clock, not per record: a slow poll does not lower the rate.
            delay = self.started_at + self.sent / self.rate - time.monotonic()
            if delay > 0:
                self._stop.wait(delay)

    def start(self) -> "KeyedStream":
        self.started_at = time.monotonic()
        self._thread.start()
        return self

    def wait_acked(self, more: int, timeout_s: float) -> int:
        """Wait until ``more`` records beyond those acknowledged now are acknowledged."""
        target = len(self.acked) + more
        deadline = time.monotonic() + timeout_s
        while len(self.acked) < target and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(self.acked)

    def wait_partitions_acked(self, partitions: int, timeout_s: float) -> int:
        """Wait until ``partitions`` partitions have had an acknowledgement; returns how many have."""
        deadline = time.monotonic() + timeout_s
        while len(self.last_ack_at) < partitions and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(self.last_ack_at)

    def wait_all_partitions_acked_after(self, since: float, timeout_s: float) -> bool:
        """Wait until every partition written so far has had an acknowledgement after ``since``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.last_ack_at and min(self.last_ack_at.values()) > since:
                return True
            time.sleep(0.05)
        return False

    def stop(self, flush_timeout_s: float = 60.0) -> int:
        """Stop writing, wait for every delivery report; returns how many never got one."""
        self._stop.set()
        self._thread.join()
        return self.producer.flush(flush_timeout_s)

    def longest_stall_s(self) -> float:
        """Longest time the stream went without an acknowledgement while it was writing."""
        times = [self.started_at, *sorted(self.ack_times)]
        return max(b - a for a, b in zip(times, times[1:]))


class GroupReader:
    """A consumer group member reading ``topic`` from the start, throughout, in a thread."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.consumer = Consumer({
            "bootstrap.servers": bootstrap, "group.id": f"durability-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "earliest", "enable.auto.commit": True, "auto.commit.interval.ms": 500,
            "session.timeout.ms": 6000, "heartbeat.interval.ms": 1000, "logger": _quiet,
        })
        self.consumer.subscribe([topic])
        self.seen: Counter[tuple[str, int]] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="group-reader", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for msg in self.consumer.consume(500, timeout=0.2):
                if msg.error() is None:
                    self.seen[(msg.key().decode(), int(msg.value()))] += 1

    def start(self) -> "GroupReader":
        self._thread.start()
        return self

    def wait_for(self, wanted: set, timeout_s: float) -> set:
        """Wait until every record in ``wanted`` was read; returns those still missing."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            missing = {r for r in wanted if r not in self.seen}
            if not missing:
                return missing
            time.sleep(0.2)
        return {r for r in wanted if r not in self.seen}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.consumer.close()


def read_topic(bootstrap: str, topic: str, partitions: int, timeout_s: float = 60.0) -> dict[int, list[tuple[int, str, int]]]:
    """Every record of ``topic`` up to its end now: partition -> [(offset, key, seq)] in offset order."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"verify-{uuid.uuid4().hex[:6]}",
                         "enable.auto.commit": False, "logger": _quiet})
    try:
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)}
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        records: dict[int, list[tuple[int, str, int]]] = defaultdict(list)
        deadline = time.monotonic() + timeout_s
        while any((records[p][-1][0] + 1 if records[p] else 0) < ends[p] for p in ends):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: could not read up to the end offsets {ends} in {timeout_s:.0f}s")
            for msg in consumer.consume(1000, timeout=0.5):
                if msg.error() is None and msg.offset() < ends[msg.partition()]:
                    records[msg.partition()].append((msg.offset(), msg.key().decode(), int(msg.value())))
        return records
    finally:
        consumer.close()


@dataclass(frozen=True)
class Report:
    scenario: str
    acknowledged: int
    lost: int  # acknowledged, not on the topic
    duplicated: int  # acknowledged, on the topic more than once
    misplaced: int  # acknowledged at an offset that holds another record
    offset_unreported: int  # acknowledged without an offset (librdkafka's OFFSET_INVALID): not misplaced
    out_of_order: int  # keys whose acknowledged records are not in sequence order on the topic
    written_unacknowledged: int  # reported failed (or never reported) yet on the topic
    failed_deliveries: int
    longest_stall_s: float
    group_missing: int  # acknowledged, never read by the consumer group
    group_redelivered: int  # read more than once by the group (at-least-once, allowed)
    misplaced_examples: tuple = ()  # up to 5 of (key, seq, acknowledged (partition, offset), found at)

    def line(self) -> str:
        return (f"[cluster] {self.scenario}: acknowledged {self.acknowledged}, lost {self.lost}, "
                f"duplicated {self.duplicated}, misplaced {self.misplaced} {list(self.misplaced_examples)}, "
                f"acknowledged without an offset {self.offset_unreported}, keys out of order {self.out_of_order}, "
                f"longest produce stall {self.longest_stall_s:.1f} s, failed deliveries {self.failed_deliveries}, "
                f"written but unacknowledged {self.written_unacknowledged}, consumer group missing "
                f"{self.group_missing} (redelivered {self.group_redelivered})")


def verify(scenario: str, stream: KeyedStream, reader: GroupReader, on_topic: dict[int, list[tuple[int, str, int]]],
           group_missing: set) -> Report:
    where: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    for partition, records in on_topic.items():
        for offset, key, seq in records:
            where[(key, seq)].append((partition, offset))
    acked = stream.acked
    lost = sum(1 for r in acked if r not in where)
    duplicated = sum(1 for r in acked if len(where.get(r, ())) > 1)
    # librdkafka may acknowledge a record without its offset (-1001, OFFSET_INVALID), e.g. when a
    # retried batch is answered DUPLICATE_SEQUENCE_NUMBER after a leader change (librdkafka #4438):
    # such a record names no position, so it cannot be misplaced; lost/duplicated still check it.
    unreported = [r for r, (_, offset) in acked.items() if offset < 0]
    wrong = [(r[0], r[1], pos, where[r]) for r, pos in acked.items() if r in where and pos[1] >= 0 and pos not in where[r]]
    misplaced = len(wrong)
    # Order is promised for acknowledged records. A record reported failed may still have been
    # written (the leader had it when the producer gave up): the application resends those.
    acked_offsets: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for (key, seq), positions in where.items():
        if (key, seq) in acked:
            acked_offsets[key].append((seq, min(positions)))
    out_of_order = 0
    for pairs in acked_offsets.values():
        offsets = [offset for _, offset in sorted(pairs)]
        out_of_order += any(b <= a for a, b in zip(offsets, offsets[1:]))
    unacked = sum(1 for r in where if r not in acked)
    return Report(scenario, len(acked), lost, duplicated, misplaced, len(unreported), out_of_order, unacked,
                  len(stream.failed), stream.longest_stall_s(), len(group_missing),
                  sum(n - 1 for r, n in reader.seen.items() if r in acked and n > 1), tuple(wrong[:5]))
