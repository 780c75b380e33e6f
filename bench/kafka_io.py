"""Throughput of the Kafka adapters the services use vs a raw confluent-kafka loop, same broker, same run.

Produce: N ~1 KB ``PromptRequest`` records (a) encoded and produced by a raw
``confluent_kafka.Producer`` loop with the same producer config (idempotence, linger, lz4,
delivery timeout) and one fixed ``traceparent`` header of the same size, since every chatpipe hop
must carry one, and (b) sent by ``AckedWriter`` (transport/acked_writer.py: the gateway's,
worker's and streams' producer) from an event loop, as the services do: a fresh child
traceparent per record, delivery reports on its own thread, an acknowledgement future on every
32nd record (as a worker acks the final chunk of a stream), the loop yielding every 1,000
records. The ratio is what the adapter's own Python work costs; a raw loop of the same records
already encoded is printed too (what encoding costs). Consume: both read the adapter's topic,
(a) a raw ``consume()`` loop and (b) ``GroupReader.poll_messages`` (transport/group_reader.py:
the worker's intake), from the first batch on (the group join is left out of both).

Each adapter side runs twice: spans off, and spans on (``transport/spans.py`` recording to a
temporary folder, as every service of the local stack does: a "send" span per record produced, a
"receive" span per batch consumed, linked to each record's producer span). The spans side counts
the recorder's export thread too: its spans are exported (``spans.shutdown()``) before the CPU
time is read, and the run fails if any span was dropped instead of exported. Each side runs
``--repeats`` times, the raw side between the two adapter sides, alternating who goes first, and
the median run counts (robust to one lucky run on a busy machine); the ratio of every alternated
pair is printed too, as the noise. Also reports consume + decode, and the codec against raw
fastavro on the same record (``codec_vs_fastavro``).

Starts its own broker (the project's local Kafka, in a temporary folder) unless
``--bootstrap-servers`` is given. Prints wall-clock rates (median and best run) and client CPU
cost, spans off and on; the last line, the headline, is the CPU-based ratio with spans on, min of
produce and consume.

``--per-thread`` adds where each produce side's client CPU went, thread by thread (the sender,
librdkafka's broker threads, the delivery-report thread, the span export thread; bench/thread_cpu.py).
"""

from __future__ import annotations

import asyncio
import gc
import io
import shutil
import statistics
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from fastavro import schemaless_reader, schemaless_writer
from local_broker import bench_broker, bench_parser  # bench/, beside this script
from thread_cpu import TICK_S, ThreadCpu, median_table

from schemas.codec import HEADER_LEN, AvroCodec, to_avro_dict
from schemas.records import ChatMessage, PromptRequest
from schemas.registry import default_registry
from transport import clients as kafka_clients
from transport import spans
from transport.acked_writer import AckedWriter
from transport.admin import TopicAdmin
from transport.group_reader import GroupReader
from transport.partitioning import LIBRDKAFKA_PARTITIONER
from transport.settings import KafkaSettings

LINGER_MS = 1.0  # the gateway's (the worker lingers 0.5 ms, streams' reply producer 0)
BATCH = 500  # messages per consume call, both sides
ACK_EVERY = 32  # the adapter side awaits an acknowledgement on every 32nd record
# CPU seconds of this process (all its threads, librdkafka's included) of the last measured loop:
# the client's own cost, which the broker sharing the same 2 cores cannot blur.
CPU_SECONDS: list[float] = []
# Garbage collections started during each measured consume loop (they were most of what the old
# BatchConsumer cost over the raw loop; transport/batches.py).
GC_STARTS = [0]
GC_PER_RUN: list[int] = []
# With --per-thread: where each produce run's client CPU went, thread by thread (bench/thread_cpu.py).
THREADS: ThreadCpu | None = None
gc.callbacks.append(lambda phase, info: GC_STARTS.__setitem__(0, GC_STARTS[0] + (phase == "start")))


FIXED_HEADER = [("traceparent", b"00-" + b"a" * 32 + b"-" + b"b" * 16 + b"-01")]


def prompt_record(i: int = 0) -> PromptRequest:
    """The ~1 KB PromptRequest of every side (900 characters of text plus the other fields)."""
    return PromptRequest(conversation_id=str(i % 64), user_id="u", tenant="t", model="m",
                         messages=[ChatMessage("user", "x" * 900)])


@contextmanager
def recording(traced: bool) -> Iterator[None]:
    """With ``traced``, spans recorded to a fresh temporary folder for the duration (removed after)."""
    if not traced:
        yield
        return
    folder = Path(tempfile.mkdtemp(prefix="chatpipe-bench-spans-"))
    spans.configure("bench", spans.TracingSettings(file_dir=folder))
    try:
        yield
    finally:
        spans.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


def export_spans(traced: bool) -> None:
    """Inside the measured window: export what is left (the export thread's CPU counts) and check
    that every span was exported, none dropped (a dropped span costs nothing to encode)."""
    if not traced:
        return
    recorder = spans._recorder
    spans.shutdown()
    if recorder is None or recorder.dropped:
        raise SystemExit(f"spans were not all exported: recorder {recorder}, dropped "
                         f"{recorder.dropped if recorder else '-'}")
    SPANS_EXPORTED.append(recorder.exported)


SPANS_EXPORTED: list[int] = []


def raw_produce(settings: KafkaSettings, topic: str, n: int, encoded: bytes | None = None) -> float:
    """Encode and produce each record (or produce ``encoded`` n times: the reference without encoding)."""
    producer = kafka_clients.raw_producer({  # the config AckedWriter gives librdkafka
        **settings.client_config(), "enable.idempotence": True, "linger.ms": LINGER_MS, "compression.type": "lz4",
        "message.timeout.ms": round(settings.delivery_timeout_s * 1000), "partitioner": LIBRDKAFKA_PARTITIONER})
    encode = AvroCodec().encode
    start, cpu0 = time.perf_counter(), time.process_time()
    if THREADS:
        THREADS.start()
    for i in range(n):
        value = encoded if encoded is not None else encode(prompt_record(i))
        while True:
            try:
                producer.produce(topic, value, key=str(i % 64), headers=FIXED_HEADER)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    producer.flush(60)
    CPU_SECONDS.append(time.process_time() - cpu0)
    if THREADS:
        THREADS.stop()
    return n / (time.perf_counter() - start)


def adapter_produce(settings: KafkaSettings, topic: str, n: int, traced: bool = False) -> float:
    async def run() -> float:
        producer = AckedWriter(settings, linger_ms=LINGER_MS)
        acks = []
        start, cpu0 = time.perf_counter(), time.process_time()
        if THREADS:
            THREADS.start()
            THREADS.name(producer._thread, "delivery-report thread")
            THREADS.name(spans._recorder._thread if spans._recorder else None, "span export thread")
        for i in range(n):
            ack = producer.send(topic, prompt_record(i), key=str(i % 64), want_ack=i % ACK_EVERY == ACK_EVERY - 1)
            if ack is not None:
                acks.append(ack)
            if i % 1000 == 999:
                await asyncio.sleep(0)  # a service's loop runs other work between sends
        await asyncio.gather(*acks)
        await asyncio.to_thread(producer.flush, 60)
        if THREADS:
            THREADS.mark()  # the export thread ends in export_spans: its CPU as of now
        export_spans(traced)
        CPU_SECONDS.append(time.process_time() - cpu0)
        if THREADS:
            THREADS.stop()
        if traced and SPANS_EXPORTED[-1] != n:
            raise SystemExit(f"{SPANS_EXPORTED[-1]} send spans exported, not {n}")
        elapsed = time.perf_counter() - start
        await asyncio.to_thread(producer.close, 10)
        return n / elapsed

    with recording(traced):
        return asyncio.run(run())


def raw_consume(settings: KafkaSettings, topic: str, n: int) -> float:
    consumer = kafka_clients.raw_consumer({**settings.client_config(), "group.id": uuid.uuid4().hex,
                                           "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    got, start = 0, None
    while got < n:
        batch = consumer.consume(BATCH, 1.0)
        if batch and start is None:
            start = time.perf_counter()  # exclude the group join from both sides
            cpu0, gc0 = time.process_time(), GC_STARTS[0]
        got += sum(1 for m in batch if m.error() is None)
    elapsed = time.perf_counter() - start
    CPU_SECONDS.append(time.process_time() - cpu0)
    GC_PER_RUN.append(GC_STARTS[0] - gc0)
    consumer.close()
    return n / elapsed


def adapter_consume(settings: KafkaSettings, topic: str, n: int, decode: bool = False, traced: bool = False) -> float:
    with recording(traced):
        consumer = GroupReader(settings, group_id=uuid.uuid4().hex, topics=[topic])
        codec = AvroCodec()
        got, start = 0, None
        while got < n:
            batch = consumer.poll_messages(BATCH, 1.0)
            if batch and start is None:
                start = time.perf_counter()
                cpu0, gc0 = time.process_time(), GC_STARTS[0]
            if decode:
                for message in batch:
                    codec.decode(message.value, PromptRequest)
            got += len(batch)
        export_spans(traced)
        elapsed = time.perf_counter() - start
        CPU_SECONDS.append(time.process_time() - cpu0)
        GC_PER_RUN.append(GC_STARTS[0] - gc0)
        consumer.close()
        return n / elapsed


def codec_vs_fastavro(ops: int, rounds: int) -> dict[str, float]:
    """The codec's encode/decode against raw fastavro on the same ~1 KB PromptRequest.

    Raw fastavro gets the best case: the record already as the dict it writes, and the same
    parsed schema the codec uses (``AvroCodec.parsed_schema``); the codec starts from the
    dataclass, checks it, adds the 10-byte header, and on decode checks the header, the
    trailing bytes and builds the dataclass. Sides alternate within each round; the figure is
    the median over rounds of each round's ratio. For reference, raw fastavro with the
    registry's schema, whose timestamp-millis it converts to and from datetimes, is timed too.
    """
    codec = AvroCodec()
    record = prompt_record()
    data = codec.encode(record)
    body, as_dict = data[HEADER_LEN:], to_avro_dict(record)
    plain, logical = codec.parsed_schema(PromptRequest), default_registry().latest("PromptRequest").parsed
    assert codec.decode(data) == record and schemaless_reader(io.BytesIO(body), plain, None) == as_dict

    def raw_write(schema):
        def run() -> None:
            for _ in range(ops):
                buf = io.BytesIO()
                schemaless_writer(buf, schema, as_dict)
                buf.getvalue()
        return run

    def raw_read(schema):
        def run() -> None:
            for _ in range(ops):
                schemaless_reader(io.BytesIO(body), schema, None)
        return run

    def codec_encode() -> None:
        for _ in range(ops):
            codec.encode(record)

    def codec_decode() -> None:
        for _ in range(ops):
            codec.decode(data)

    sides = {"encode/raw": raw_write(plain), "encode/codec": codec_encode,
             "decode/raw": raw_read(plain), "decode/codec": codec_decode,
             "encode/raw-logical": raw_write(logical), "decode/raw-logical": raw_read(logical)}
    times: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(rounds):
        for side, run in sides.items():
            start = time.perf_counter()
            run()
            times[side].append((time.perf_counter() - start) / ops * 1e6)  # microseconds per record
    best = {side: min(t) for side, t in times.items()}
    out = {f"{side} us": us for side, us in best.items()}
    print(f"\ncodec vs raw fastavro, ~1 KB PromptRequest ({len(data)} bytes), {rounds} rounds of {ops:,} "
          f"records per side, sides alternating within each round:")
    for op, raw_name in (("encode", "schemaless_writer"), ("decode", "schemaless_reader")):
        # Each round's ratio compares neighbours in time, so a slow stretch of the machine hits
        # both; the median over rounds is the figure, the quartiles its noise.
        paired = sorted(raw / mine for raw, mine in zip(times[f"{op}/raw"], times[f"{op}/codec"]))
        q1, med, q3 = statistics.quantiles(paired, n=4)
        logical = statistics.median(raw / mine for raw, mine in zip(times[f"{op}/raw-logical"], times[f"{op}/codec"]))
        out[f"{op} ratio"], out[f"{op} ratio logical"] = med, logical
        out[f"{op} ratio best"] = best[f"{op}/raw"] / best[f"{op}/codec"]
        print(f"  {op}: codec/raw {raw_name} speed ratio {med:.2f} (median of rounds; quartiles {q1:.2f}-{q3:.2f}); "
              f"best rounds raw {best[f'{op}/raw']:.2f} us, codec {best[f'{op}/codec']:.2f} us per record "
              f"({out[f'{op} ratio best']:.2f}); vs fastavro with the registry's timestamp-millis schema "
              f"{logical:.2f}")
    return out


def measure(bootstrap: str, n: int, repeats: int, codec_sizes: tuple[int, int]) -> str:
    """Runs every side; returns the headline line (printed last by main)."""
    settings = KafkaSettings(bootstrap_servers=bootstrap)
    admin = TopicAdmin(settings)
    runs: dict[str, list[float]] = {}
    per_thread: dict[str, list[dict[str, float]]] = {}

    adapter_topics = []
    encoded = AvroCodec().encode(prompt_record())
    pre_encoded = lambda settings, t, n: raw_produce(settings, t, n, encoded=encoded)
    traced_produce = lambda settings, t, n: adapter_produce(settings, t, n, traced=True)
    traced_consume = lambda settings, t, n: adapter_consume(settings, t, n, traced=True)
    # The raw side between the two adapter sides: each adapter run has a raw run next to it in time,
    # and the order flips every repeat.
    sides = (("adapter", adapter_produce), ("raw", raw_produce), ("adapter+spans", traced_produce),
             ("raw-bytes", pre_encoded))
    for r in range(repeats):
        for side, fn in sides if r % 2 == 0 else sides[::-1]:  # alternate who goes first
            t = f"bench.kafka_io.{uuid.uuid4().hex[:8]}"  # a topic of each run's own
            admin.create_topic(t, 6)
            rate = fn(settings, t, n)
            if side == "adapter":
                adapter_topics.append(t)
            runs.setdefault(f"produce/{side}", []).append(rate)
            runs.setdefault(f"produce-cpu/{side}", []).append(n / CPU_SECONDS[-1])
            if THREADS and side != "raw-bytes":
                per_thread.setdefault(side, []).append(THREADS.result)
            print(f"run {r + 1}: produce {side:13} {rate:10,.0f} msg/s, {n / CPU_SECONDS[-1]:10,.0f} msg per "
                  f"CPU-second" + (f", {SPANS_EXPORTED[-1]:,} spans exported" if side == "adapter+spans" else ""))
    sides = (("adapter", adapter_consume), ("raw", raw_consume), ("adapter+spans", traced_consume))
    for r in range(repeats):
        for side, fn in sides if r % 2 == 0 else sides[::-1]:
            rate = fn(settings, adapter_topics[r], n)  # the same messages for every side
            runs.setdefault(f"consume/{side}", []).append(rate)
            runs.setdefault(f"consume-cpu/{side}", []).append(n / CPU_SECONDS[-1])
            runs.setdefault(f"consume-gc/{side}", []).append(GC_PER_RUN[-1])
            print(f"run {r + 1}: consume {side:13} {rate:10,.0f} msg/s, {n / CPU_SECONDS[-1]:10,.0f} msg per "
                  f"CPU-second, {GC_PER_RUN[-1]} garbage collections"
                  + (f", {SPANS_EXPORTED[-1]:,} spans exported" if side == "adapter+spans" else ""))
    results = {name: statistics.median(rates) for name, rates in runs.items()}
    best = {name: max(rates) for name, rates in runs.items()}
    results["consume/records"] = adapter_consume(settings, adapter_topics[0], n, decode=True)

    print(f"\n{n:,} PromptRequests of ~1 KB ({len(encoded)} bytes), median of {repeats}, broker {bootstrap}")
    print(f"produce: raw (encode + produce) {results['produce/raw']:,.0f} msg/s, AckedWriter "
          f"{results['produce/adapter']:,.0f} msg/s (ratio {results['produce/adapter'] / results['produce/raw']:.2f}), "
          f"with spans {results['produce/adapter+spans']:,.0f} msg/s "
          f"({results['produce/adapter+spans'] / results['produce/raw']:.2f}); raw of pre-encoded bytes "
          f"{results['produce/raw-bytes']:,.0f} msg/s")
    print(f"consume: raw {results['consume/raw']:,.0f} msg/s, GroupReader {results['consume/adapter']:,.0f} msg/s "
          f"(ratio {results['consume/adapter'] / results['consume/raw']:.2f}), with spans "
          f"{results['consume/adapter+spans']:,.0f} msg/s ({results['consume/adapter+spans'] / results['consume/raw']:.2f})")
    print(f"best runs: produce ratio {best['produce/adapter'] / best['produce/raw']:.2f}, with spans "
          f"{best['produce/adapter+spans'] / best['produce/raw']:.2f}; consume ratio "
          f"{best['consume/adapter'] / best['consume/raw']:.2f}, with spans "
          f"{best['consume/adapter+spans'] / best['consume/raw']:.2f}")
    cpu = {f"{op}/{side}": results[f"{op}-cpu/{side}"] / results[f"{op}-cpu/raw"]
           for op in ("produce", "consume") for side in ("adapter", "adapter+spans")}
    print("client CPU cost (messages per CPU-second of this process):")
    for op in ("produce", "consume"):
        print(f"  {op}: raw {results[f'{op}-cpu/raw']:,.0f}, adapter {results[f'{op}-cpu/adapter']:,.0f} "
              f"(ratio {cpu[f'{op}/adapter']:.2f}), adapter with spans {results[f'{op}-cpu/adapter+spans']:,.0f} "
              f"(ratio {cpu[f'{op}/adapter+spans']:.2f})")
    # The noise, run by run: each adapter run against the raw run next to it.
    for kind in ("produce-cpu", "consume", "consume-cpu"):
        for side in ("adapter", "adapter+spans"):
            pairs = sorted(a / b for a, b in zip(runs[f"{kind}/{side}"], runs[f"{kind}/raw"]))
            print(f"{kind} ratio per alternated pair, {side}: {', '.join(f'{p:.2f}' for p in pairs)} "
                  f"(median {statistics.median(pairs):.2f})")
    if per_thread:
        print(f"produce, client CPU by thread ({repeats} runs a side; the kernel's ticks resolve "
              f"{1e6 * TICK_S / n:.2f} us a record):")
        print("\n".join(median_table(per_thread, n)))
    print(f"garbage collections per consume run: raw {runs['consume-gc/raw']}, adapter {runs['consume-gc/adapter']}, "
          f"adapter with spans {runs['consume-gc/adapter+spans']}")
    codec_vs_fastavro(*codec_sizes)
    print(f"consume + decode (GroupReader, AvroCodec): {results['consume/records']:,.0f} msg/s "
          f"({results['consume/records'] / results['consume/raw']:.2f} of the raw consume loop)")
    print(f"spans off: transport/kafka_io adapter/raw throughput ratio (messages per client CPU-second, "
          f"min of produce and consume) = {min(cpu['produce/adapter'], cpu['consume/adapter']):.2f}")
    # Headline on client CPU: with the broker on the same 2 cores, wall-clock rates swing with
    # what else runs; CPU per message is the adapters' own cost and swings less. Spans on: what the
    # services run (every service of the stack records spans).
    return (f"transport/kafka_io adapter+spans/raw throughput ratio (messages per client CPU-second, "
            f"min of produce and consume) = {min(cpu['produce/adapter+spans'], cpu['consume/adapter+spans']):.2f}")


def main() -> None:
    parser = bench_parser(__doc__, "about a minute on 2 cores")
    parser.add_argument("--messages", type=int, default=None, help="messages per run (default 200k, quick 60k)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per side (default 7, quick 5)")
    parser.add_argument("--per-thread", action="store_true",
                        help="also print where each produce side's client CPU went, thread by thread (Linux)")
    args = parser.parse_args()
    if args.per_thread:
        global THREADS
        THREADS = ThreadCpu()
    n = args.messages or (60_000 if args.quick else 200_000)
    repeats = args.repeats or (5 if args.quick else 7)

    with bench_broker(args.bootstrap_servers) as bootstrap:
        headline = measure(bootstrap, n, repeats, (1_000, 100) if args.quick else (2_000, 150))
    print(headline, flush=True)


if __name__ == "__main__":
    main()
