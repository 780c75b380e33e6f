"""Throughput of chatpipe's Kafka adapters vs a raw confluent-kafka loop, same broker, same run.

Produces N messages of 1 KB with (a) a raw ``confluent_kafka.Producer`` loop using the same
producer config (idempotence, linger, lz4) and (b) ``RecordProducer.send_bytes`` (a fresh child
traceparent per message, delivery checks). Both put the same records on the wire: the raw loop
sends one fixed traceparent header of the same size, since every chatpipe hop must carry one;
the ratio is therefore what the adapter's own Python work costs. (A raw loop without any header
is printed too, for reference.) Then both consumers read the same topic: (a) a raw
``consume()`` loop and (b) ``BatchConsumer.poll_messages``. Each side runs ``--repeats`` times, alternating, and
the median run counts (robust to one lucky run on a busy machine). Also reports the Avro record path (encode + produce, consume + decode).

Starts its own broker (the project's local Kafka, in a temporary folder) unless
``--bootstrap-servers`` is given. Prints wall-clock rates (median and best run) and client CPU
cost; the last line, the headline, is the CPU-based ratio, min of produce and consume.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import os
import socket
import tempfile
import time
import uuid

from confluent_kafka import Consumer, Producer

from schemas.codec import AvroCodec
from schemas.records import ChatMessage, PromptRequest
from transport.admin import TopicAdmin
from transport.consumer import BatchConsumer
from transport.producer import RecordProducer
from transport.settings import KafkaSettings

PAYLOAD = os.urandom(1024)
# CPU seconds of this process (all its threads, librdkafka's included) of the last measured loop:
# the client's own cost, which the broker sharing the same 2 cores cannot blur.
CPU_SECONDS: list[float] = []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FIXED_HEADER = [("traceparent", b"00-" + b"a" * 32 + b"-" + b"b" * 16 + b"-01")]


def raw_produce(settings: KafkaSettings, topic: str, n: int, headers: list | None = FIXED_HEADER) -> float:
    producer = Producer({**settings.client_config(), "enable.idempotence": True,
                         "linger.ms": settings.producer_linger_ms, "batch.size": settings.producer_batch_bytes,
                         "compression.type": "lz4"})
    start, cpu0 = time.perf_counter(), time.process_time()
    for i in range(n):
        while True:
            try:
                producer.produce(topic, PAYLOAD, key=str(i % 64), headers=headers)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    producer.flush(60)
    CPU_SECONDS.append(time.process_time() - cpu0)
    return n / (time.perf_counter() - start)


def adapter_produce(settings: KafkaSettings, topic: str, n: int) -> float:
    producer = RecordProducer(settings)
    start, cpu0 = time.perf_counter(), time.process_time()
    for i in range(n):
        producer.send_bytes(topic, PAYLOAD, key=str(i % 64))
    producer.flush(60)
    CPU_SECONDS.append(time.process_time() - cpu0)
    return n / (time.perf_counter() - start)


def record_produce(settings: KafkaSettings, topic: str, n: int) -> float:
    producer = RecordProducer(settings, codec=AvroCodec(validate_on_encode=False))
    text = "x" * 900  # with the other fields, about 1 KB on the wire
    start = time.perf_counter()
    for i in range(n):
        producer.send(topic, PromptRequest(conversation_id=str(i % 64), user_id="u", tenant="t", model="m",
                                           messages=[ChatMessage("user", text)]), key=str(i % 64))
    producer.flush(60)
    return n / (time.perf_counter() - start)


def raw_consume(settings: KafkaSettings, topic: str, n: int) -> float:
    consumer = Consumer({**settings.client_config(), "group.id": uuid.uuid4().hex,
                         "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    got, start = 0, None
    while got < n:
        batch = consumer.consume(settings.consumer_batch_size, 1.0)
        if batch and start is None:
            start = time.perf_counter()  # exclude the group join from both sides
            cpu0 = time.process_time()
        got += sum(1 for m in batch if m.error() is None)
    elapsed = time.perf_counter() - start
    CPU_SECONDS.append(time.process_time() - cpu0)
    consumer.close()
    return n / elapsed


def adapter_consume(settings: KafkaSettings, topic: str, n: int, decode: bool = False) -> float:
    consumer = BatchConsumer(settings, group_id=uuid.uuid4().hex, topics=[topic],
                             on_decode_error=lambda exc, msg: None)
    got, start = 0, None
    while got < n:
        batch = consumer.poll_records() if decode else consumer.poll_messages()
        if batch and start is None:
            start = time.perf_counter()
            cpu0 = time.process_time()
        got += len(batch)
    elapsed = time.perf_counter() - start
    CPU_SECONDS.append(time.process_time() - cpu0)
    consumer.close()
    return n / elapsed


def measure(bootstrap: str, n: int, repeats: int) -> str:
    """Runs every side; returns the headline line (printed last by main)."""
    settings = KafkaSettings(bootstrap_servers=bootstrap)
    admin = TopicAdmin(settings)
    runs: dict[str, list[float]] = {}

    def topic() -> str:
        name = f"bench.kafka_io.{uuid.uuid4().hex[:8]}"
        admin.create_topic(name, 6)
        return name

    adapter_topics = []
    no_headers = lambda settings, t, n: raw_produce(settings, t, n, headers=None)  # noqa: E731
    for r in range(repeats):
        for side, fn in (("raw", raw_produce), ("adapter", adapter_produce), ("raw-nohdr", no_headers)):
            t = topic()
            rate = fn(settings, t, n)
            if side == "adapter":
                adapter_topics.append(t)
            runs.setdefault(f"produce/{side}", []).append(rate)
            runs.setdefault(f"produce-cpu/{side}", []).append(n / CPU_SECONDS[-1])
            print(f"run {r + 1}: produce {side:9} {rate:10,.0f} msg/s")
    for r in range(repeats):
        for side, fn in (("raw", raw_consume), ("adapter", adapter_consume)):
            rate = fn(settings, adapter_topics[r], n)  # the same messages for both sides
            runs.setdefault(f"consume/{side}", []).append(rate)
            runs.setdefault(f"consume-cpu/{side}", []).append(n / CPU_SECONDS[-1])
            print(f"run {r + 1}: consume {side:9} {rate:10,.0f} msg/s")
    results = {name: statistics.median(rates) for name, rates in runs.items()}
    best = {name: max(rates) for name, rates in runs.items()}
    rec_topic = topic()
    results["produce/records"] = record_produce(settings, rec_topic, n)
    results["consume/records"] = adapter_consume(settings, rec_topic, n, decode=True)

    produce_ratio = results["produce/adapter"] / results["produce/raw"]
    consume_ratio = results["consume/adapter"] / results["consume/raw"]
    print(f"\n{n:,} messages of 1 KB, median of {repeats}, broker {bootstrap}")
    print(f"produce: raw {results['produce/raw']:,.0f} msg/s, adapter {results['produce/adapter']:,.0f} msg/s, "
          f"ratio {produce_ratio:.2f} (raw without headers {results['produce/raw-nohdr']:,.0f} msg/s)")
    print(f"consume: raw {results['consume/raw']:,.0f} msg/s, adapter {results['consume/adapter']:,.0f} msg/s, "
          f"ratio {consume_ratio:.2f}")
    print(f"best runs: produce ratio {best['produce/adapter'] / best['produce/raw']:.2f}, consume ratio "
          f"{best['consume/adapter'] / best['consume/raw']:.2f}")
    cpu_p = results["produce-cpu/adapter"] / results["produce-cpu/raw"]
    cpu_c = results["consume-cpu/adapter"] / results["consume-cpu/raw"]
    print(f"client CPU cost (messages per CPU-second of this process): produce raw "
          f"{results['produce-cpu/raw']:,.0f}, adapter {results['produce-cpu/adapter']:,.0f} (ratio {cpu_p:.2f}); "
          f"consume raw {results['consume-cpu/raw']:,.0f}, adapter {results['consume-cpu/adapter']:,.0f} "
          f"(ratio {cpu_c:.2f})")
    print(f"Avro records (~1 KB PromptRequest): encode+produce {results['produce/records']:,.0f} msg/s "
          f"({results['produce/records'] / results['produce/raw']:.2f} of raw bytes), consume+decode "
          f"{results['consume/records']:,.0f} msg/s ({results['consume/records'] / results['consume/raw']:.2f})")
    # Headline on client CPU: with the broker on the same 2 cores, wall-clock consume rates are
    # bimodal for both sides alike (~90k or ~157k msg/s from run to run); CPU per message is the
    # adapters' own cost and stays put.
    return (f"transport/kafka_io adapter/raw throughput ratio (messages per client CPU-second, "
            f"min of produce and consume) = {min(cpu_p, cpu_c):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="about a minute on 2 cores")
    parser.add_argument("--messages", type=int, default=None, help="messages per run (default 200k, quick 60k)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per side (default 5, quick 3)")
    parser.add_argument("--bootstrap-servers", default=None, help="use this broker instead of starting one")
    args = parser.parse_args()
    n = args.messages or (60_000 if args.quick else 200_000)
    repeats = args.repeats or (3 if args.quick else 5)

    kafka = None
    bootstrap = args.bootstrap_servers
    if bootstrap is None:
        from infra.local_kafka import LocalKafka
        from infra.settings import StackSettings

        kafka = LocalKafka(StackSettings(state_dir=tempfile.mkdtemp(prefix="chatpipe-bench-"),
                                         kafka_port=_free_port(), controller_port=_free_port()))
        kafka.up()
        bootstrap = kafka.settings.bootstrap_servers
    try:
        headline = measure(bootstrap, n, repeats)
    finally:
        gc.collect()  # close leftover clients before the broker goes, to keep their logs quiet
        if kafka is not None:
            kafka.down()
    print(headline, flush=True)


if __name__ == "__main__":
    main()
