"""What ``fetch.wait.max.ms`` costs: one record's hop latency, and the broker CPU idle consumers take.

The latency-bound consumers (the gateway's reply reader, the worker's partition intake) used
``fetch.wait.max.ms`` 5, on the idea that a short wait sees a new record sooner. But the broker
answers a waiting fetch as soon as a record is appended to its partition (``fetch.min.bytes`` 1), so
the setting bounds only a fetch that finds nothing: with 5 ms an idle consumer sends ~200 fetches
a second, and the broker serves them all. This script measures both sides on the project's own
broker, same run, the settings alternating:

1. Hop latency: an idle consumer per setting (its own topic), one record produced (linger 0.5 ms,
   acks all, as the worker's chunks), time until ``consume`` returns it; the gap between records
   (0.2 s) leaves each consumer's fetch waiting at the broker, the case the setting is about.
2. Broker CPU: ``--consumers`` idle consumers of one setting for ``--idle-s`` seconds; the broker
   process's CPU time (``/proc/<pid>/stat``) over that window, per setting.

    python bench/kafka_hop.py --quick   # about a minute on 2 cores
    python bench/kafka_hop.py

The last line is the headline: broker CPU of idle consumers at 5 ms over that at 100 ms.
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import NewTopic

from transport import clients as kafka_clients  # raw: the hop's baseline, no chatpipe settings

from local_broker import bench_broker, bench_parser, broker_pid, cpu_s  # bench/, beside this script

WAITS_MS = (5, 100)


def idle_consumer(bootstrap: str, topic: str, wait_ms: int) -> Consumer:
    consumer = kafka_clients.raw_consumer({"bootstrap.servers": bootstrap, "group.id": f"hop-{uuid.uuid4().hex[:6]}",
                                           "enable.auto.commit": False, "fetch.wait.max.ms": wait_ms,
                                           "fetch.min.bytes": 1})
    consumer.assign([TopicPartition(topic, 0, -1)])  # -1: the end
    consumer.consume(10, 1.0)  # connected, fetching
    return consumer


def read_one(consumer: Consumer) -> None:
    while not [m for m in (consumer.consume(500, 0) or consumer.consume(1, 1.0)) if m.error() is None]:
        pass


def hop_latencies(bootstrap: str, topics: dict[int, str], samples: int) -> dict[int, list[float]]:
    producer = kafka_clients.raw_producer({"bootstrap.servers": bootstrap, "linger.ms": 0.5, "acks": "all"})
    consumers = {w: idle_consumer(bootstrap, topics[w], w) for w in WAITS_MS}
    took: dict[int, list[float]] = {w: [] for w in WAITS_MS}
    try:
        for i in range(samples):
            for w in (WAITS_MS if i % 2 == 0 else WAITS_MS[::-1]):  # alternate who goes first
                time.sleep(0.2)
                started = time.perf_counter()
                producer.produce(topics[w], b"x")
                producer.poll(0)
                read_one(consumers[w])
                took[w].append((time.perf_counter() - started) * 1e3)
        producer.flush(10)
    finally:
        for consumer in consumers.values():
            consumer.close()
    return took


def idle_broker_cpu(bootstrap: str, broker_pid: int, topic: str, wait_ms: int, consumers: int,
                    idle_s: float) -> float:
    """Broker CPU seconds per second while ``consumers`` idle consumers fetch with ``wait_ms``."""
    open_ = [idle_consumer(bootstrap, topic, wait_ms) for _ in range(consumers)]
    try:
        before, started = cpu_s(broker_pid), time.monotonic()
        deadline = started + idle_s
        while time.monotonic() < deadline:
            for consumer in open_:
                consumer.consume(100, 0.05)
        return (cpu_s(broker_pid) - before) / (time.monotonic() - started)
    finally:
        for consumer in open_:
            consumer.close()


def main() -> None:
    parser = bench_parser(__doc__.split("\n")[0], "about a minute on 2 cores")
    parser.add_argument("--consumers", type=int, default=4, help="idle consumers during the CPU window")
    args = parser.parse_args()
    samples, idle_s, rounds = (40, 8.0, 1) if args.quick else (150, 20.0, 2)

    with bench_broker(args.bootstrap_servers, prefix="chatpipe-bench-hop-") as bootstrap:
        pid = broker_pid(bootstrap)
        if pid is None:
            raise SystemExit(f"no local broker process serves {bootstrap}: its CPU cannot be read")
        topics = {w: f"hop-{w}-{uuid.uuid4().hex[:6]}" for w in WAITS_MS}
        idle_topic = f"hop-idle-{uuid.uuid4().hex[:6]}"
        admin = kafka_clients.raw_admin({"bootstrap.servers": bootstrap})
        for future in admin.create_topics([NewTopic(t, 1, 1) for t in [*topics.values(), idle_topic]]).values():
            future.result()

        took = hop_latencies(bootstrap, topics, samples)
        cpu: dict[int, list[float]] = {w: [] for w in WAITS_MS}
        for r in range(rounds):
            for w in (WAITS_MS if r % 2 == 0 else WAITS_MS[::-1]):
                cpu[w].append(idle_broker_cpu(bootstrap, pid, idle_topic, w, args.consumers, idle_s))

    print(f"one record's hop, producer (linger 0.5 ms, acks all) -> idle consumer, {samples} each, alternating:")
    for w in WAITS_MS:
        v = sorted(took[w])
        print(f"  fetch.wait.max.ms {w:>3}: p50 {statistics.median(v):6.2f} ms  p90 {v[int(0.9 * len(v))]:6.2f} ms")
    print(f"broker CPU with {args.consumers} idle consumers ({idle_s:g} s windows):")
    for w in WAITS_MS:
        print(f"  fetch.wait.max.ms {w:>3}: {100 * statistics.median(cpu[w]):5.1f}% of a core")
    low, high = WAITS_MS
    print(f"kafka/hop p50 latency, fetch.wait.max.ms {high} vs {low}: ratio = "
          f"{statistics.median(took[high]) / statistics.median(took[low]):.2f}")
    print(f"kafka/hop broker CPU of idle consumers, fetch.wait.max.ms {low} vs {high} ratio = "
          f"{statistics.median(cpu[low]) / max(statistics.median(cpu[high]), 1e-9):.2f}")


if __name__ == "__main__":
    main()
