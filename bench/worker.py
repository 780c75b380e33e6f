"""Kafka + inference worker vs the engine alone, on the same requests, in one run.

1. Throughput: N chat requests at once (greedy, the same prompts and max_tokens) through
   (a) the engine alone, in this process (``AsyncEngine``, text deltas as the worker makes them),
   (b) Kafka + one ``chatpipe inference`` process with the same engine settings: requests produced
       to ``chat.inference.requests``, token chunks and Responses read back. The chunks of all the
       requests go to one partition of ``chat.replies``, as a gateway asks for its own replies
       (``--reply-partitions N``: spread over N, as N askers would; the broker then takes a produce
       request per partition per engine step, as librdkafka sends one partition per request).
   The worker streams at its default cadence (``chunk_interval_ms``, 100 ms: at most a chunk per
   stream per 100 ms window); ``CHATPIPE_WORKER_CHUNK_INTERVAL_MS=0`` in the environment gives a
   chunk per token.
   tokens/s = output tokens / wall time from the first submit (produce) to the last answer. The
   sides alternate for a few rounds (10 with ``--quick``, of about 1.5 s each: rounds of one side
   differ by up to 20% on a shared 2-core VM, and with 5 the Kafka side's best was often not a
   quiet one) and the best round of each is compared (the least disturbed one); the median of the
   paired rounds' ratios is printed beside it.
2. Added time to first token from the Kafka hops: each prompt alone, produced to Kafka, timed
   from produce to its first TokenChunk read back, minus the worker's own time on that request
   (chat template + engine until the first chunk is sent, carried in the chunk's
   ``chatpipe-engine-us`` header; the engine-alone side does the same work);
   p50 / p99 of that difference. The engine alone's TTFT on the same prompts is printed beside it.
3. ``partition`` vs ``share`` intake with 2 workers (1 torch thread each) under a skewed load:
   most requests on 2 conversations (so on at most 2 partitions); time to finish the whole load.

Starts its own broker unless ``--bootstrap-servers`` is given. The last line is the headline:
``worker/kafka+worker vs engine tokens/s ratio = X``.

``--engine vllm``: vLLM's engine on both sides (``inference.vllm_engine.VllmEngine`` alone in this process,
and ``chatpipe inference --engine vllm``), so the ratio is what the pipeline costs around vLLM's engine;
the bench then runs in the vLLM environment (infra/vllm_env.py, `make setup-vllm`), and part 3 (the intake
modes, which do not depend on the engine) is left out.

    python bench/worker.py --quick     # about a minute or two on 2 CPU cores
    python bench/worker.py             # the docs/benchmarks.md figures
    python bench/worker.py --engine vllm [--quick]
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from local_broker import (add_engine_arg, bench_broker, bench_parser, engine_alone, enter_engine_env, fresh_kafka,
                          load_engine, percentile)  # bench/, beside this script

from chatpipe.testing.worker import Reader, make_request, send_requests, start_worker
from inference.worker.settings import WorkerSettings
from schemas.topics import REPLIES
from transport.partitioning import partition_of


def prompts(n: int, max_tokens: int, kafka, *, conversations=None, reply_partitions: int = 1) -> list:
    return [make_request(i, conversation=(conversations[i] if conversations else None), max_tokens=max_tokens,
                         reply_to=kafka.topic(REPLIES), reply_partition=i % reply_partitions,
                         text=f"Tell me a fact about the number {i} and why it matters.") for i in range(n)]


# -- through Kafka ---------------------------------------------------------------------------------

def through_kafka(kafka, reader: Reader, requests, producer) -> tuple[float, int, list[float]]:
    """(seconds, output tokens, ttft per request) through Kafka and the worker; the requests all at once."""
    sent = time.perf_counter()
    send_requests(kafka, requests, producer)
    ids = {r.request_id for r in requests}
    first_seen: dict[str, float] = {}
    while not ids <= set(reader.seen.responses):
        reader.poll(0.05)  # returns at the first record
        now = time.perf_counter()
        for rid in ids:
            if rid not in first_seen and reader.seen.chunk_count.get(rid):
                first_seen[rid] = now
    ttft = [first_seen.get(rid, time.perf_counter()) - sent for rid in sorted(ids)]
    elapsed = time.perf_counter() - sent
    tokens = sum(reader.seen.first_response(r.request_id)[0].tokens_out for r in requests)
    return elapsed, tokens, ttft


def hot_pair(partitions: int = 6) -> tuple[str, str]:
    """Two conversation ids on the same partition under the project's partitioner (Kafka's murmur2,
    ``transport.partitioning``; the bench's producer uses it). With 6 partitions two hot
    conversations share one 1 time in 6 (and share one of 2 workers half the time); this is that
    case, made certain."""
    a = "hot-a"
    b = next(f"hot-b{k}" for k in range(1000) if partition_of(f"hot-b{k}", partitions) == partition_of(a, partitions))
    return a, b


def skewed_load(kafka, tmp: Path, intake: str, n: int, max_tokens: int) -> float:
    """Seconds for 2 workers of ``intake`` to answer n requests, 80% of them on 2 conversations
    (``kafka``: topics of its own)."""
    hot_a, hot_b = hot_pair()
    conversations = [(hot_a if i % 2 else hot_b) if i % 5 else f"cold-{i}" for i in range(n)]
    workers = [start_worker(kafka, tmp, intake=intake, worker_id=f"{intake}-{k}", CHATPIPE_NUM_THREADS="1",
                            CHATPIPE_MAX_BATCH="4") for k in range(2)]
    reader = Reader(kafka)
    try:
        for w in workers:
            w.wait_serving()
        # Both workers joined and answering before the clock starts (a share group's assignment
        # reaches a new member with its next heartbeat, seconds later).
        answering: set[str] = set()
        deadline = time.monotonic() + 90
        while len(answering) < 2 and time.monotonic() < deadline:
            warm = [make_request(10_000 + k, conversation=f"warm-{uuid.uuid4().hex[:6]}", max_tokens=2)
                    for k in range(6)]
            send_requests(kafka, warm)
            reader.wait_responses([r.request_id for r in warm], 120)
            answering |= {reader.seen.first_response(r.request_id)[0].worker_id for r in warm}
        requests = prompts(n, max_tokens, kafka, conversations=conversations)
        started = time.perf_counter()
        send_requests(kafka, requests)
        ids = {r.request_id for r in requests}
        reader.wait_for(lambda seen: ids <= set(seen.responses) or seen.dead_letters, 600, "the skewed load")
        if reader.seen.dead_letters:
            raise SystemExit(f"{intake}: {len(reader.seen.dead_letters)} request(s) dead-lettered: "
                             f"{reader.seen.dead_letters[0].error_message}")
        elapsed = time.perf_counter() - started
        per_worker = dict(Counter(reader.seen.first_response(r.request_id)[0].worker_id for r in requests))
        print(f"  {intake:9} 2 workers: {elapsed:6.1f} s for {n} requests; answered per worker {per_worker}")
        return elapsed
    finally:
        reader.close()
        for w in workers:
            w.terminate()


KAFKA_WARM_ROUNDS = 5  # untimed rounds through the broker before the timed ones (about 2 s each)
ENGINE_SETTINGS = {"device": "cpu", "max_batch": 8, "kv_cache_tokens": 8192, "max_seq_len": 512, "num_threads": 2}


def main() -> None:
    parser = bench_parser(__doc__, "about a minute or two on 2 cores")
    add_engine_arg(parser, "the engine on both sides")
    parser.add_argument("--reply-partitions", type=int, default=1, choices=range(1, 7), metavar="1-6",
                        help="partitions of chat.replies the chunks go to (1: one asker, as a gateway)")
    args = parser.parse_args()
    enter_engine_env(args.engine, __file__, ENGINE_SETTINGS["num_threads"])
    with bench_broker(args.bootstrap_servers, prefix="chatpipe-bench-worker-") as bootstrap:
        run(bootstrap, args.quick, args.engine, args.reply_partitions)


def run(bootstrap: str, quick: bool, engine_name: str = "chatpipe", reply_partitions: int = 1) -> None:
    n, max_tokens, n_ttft, n_skew, rounds = (12, 16, 10, 20, 10) if quick else (48, 48, 40, 60, 3)

    from inference.engine.settings import EngineSettings

    tmp = Path(tempfile.mkdtemp(prefix="chatpipe-bench-worker-logs-"))

    # Same engine settings on both sides (the worker reads them from CHATPIPE_* variables).
    engine_env = {f"CHATPIPE_{name.upper()}": str(value) for name, value in ENGINE_SETTINGS.items()}
    settings = EngineSettings(**ENGINE_SETTINGS)
    engine, tokenizer = load_engine(engine_name, settings)
    kafka = fresh_kafka(bootstrap)
    requests = prompts(n, max_tokens, kafka, reply_partitions=reply_partitions)
    ttft_requests = prompts(n_ttft, 4, kafka, reply_partitions=reply_partitions)

    from chatpipe.testing.kafka import RecordWriter

    producer = RecordWriter(kafka, extra_config={"linger.ms": 0})
    worker = start_worker(kafka, tmp, worker_id="bench", engine=engine_name, **engine_env)
    reader = Reader(kafka)
    e_runs, k_runs, e_ttft, k_ttft, k_engine = [], [], [], [], []
    try:
        worker.wait_serving()
        # Warm-up: whole untimed rounds, so that neither side's first round pays for what a serving
        # worker pays once (the oneDNN kernels of each new batch size, the broker JVM's first
        # compilation of its produce and fetch paths: its CPU per round of this load fell from 0.42
        # to ~0.2 s over its first 5-8 rounds, and it is a JVM sharing the two cores with the model).
        asyncio.run(engine_alone(engine, tokenizer, requests))
        for warm in range(KAFKA_WARM_ROUNDS):
            through_kafka(kafka, reader, [make_copy(r, f"warm{warm}") for r in requests], producer)
        # Alternate the two sides, so that load from other jobs on the machine hits both alike;
        # the best run of each side is compared (the least disturbed one).
        for round_no in range(rounds):
            secs, outs, _, _ = asyncio.run(engine_alone(engine, tokenizer, requests))
            e_runs.append(sum(outs) / secs)
            secs, tokens, _ = through_kafka(kafka, reader, [make_copy(r, f"t{round_no}") for r in requests], producer)
            k_runs.append(tokens / secs)
        for i, req in enumerate(ttft_requests):  # each prompt on both sides, back to back
            e_ttft += asyncio.run(engine_alone(engine, tokenizer, [req]))[2]
            copy = make_copy(req, f"f{i}")
            k_ttft += through_kafka(kafka, reader, [copy], producer)[2]
            k_engine.append(reader.seen.engine_us[copy.request_id] / 1e6)
    finally:
        reader.close()
        worker.terminate()
    if hasattr(engine, "shutdown"):  # vLLM's: its executor and KV cache
        engine.shutdown()
    del engine

    e_rate, k_rate = max(e_runs), max(k_runs)
    # What the hops added: the client's TTFT minus the worker's own time on the same request
    # (chat template + engine until the first chunk is sent, its chatpipe-engine-us header). Subtracting
    # the engine-alone run's TTFT instead would fold two prefills' run-to-run noise into it.
    added = [(k - e) * 1000 for k, e in zip(k_ttft, k_engine)]
    print(f"\nengine {engine_name}: {n} requests x max {max_tokens} tokens, greedy, max_batch 8, {rounds} alternating "
          f"rounds per side, chunks to {reply_partitions} reply partition(s), "
          f"chunk_interval_ms {WorkerSettings().chunk_interval_ms:g}")
    print(f"  engine alone     : best {e_rate:7.1f} tokens/s (rounds: {', '.join(f'{r:.1f}' for r in e_runs)})")
    print(f"  kafka + worker   : best {k_rate:7.1f} tokens/s (rounds: {', '.join(f'{r:.1f}' for r in k_runs)})")
    paired = statistics.median(k / e for k, e in zip(k_runs, e_runs))
    print(f"  median of the rounds' ratios (each Kafka round over the engine round just before it): {paired:.2f}")
    print(f"time to first token, {n_ttft} prompts one at a time, each on both sides back to back (ms): engine p50 "
          f"{statistics.median(e_ttft) * 1000:.1f} / kafka p50 {statistics.median(k_ttft) * 1000:.1f} "
          f"(of which the worker's engine p50 {statistics.median(k_engine) * 1000:.1f})")
    print(f"  added by the Kafka hops: p50 {percentile(added, 0.5):.1f} ms, p99 {percentile(added, 0.99):.1f} ms")
    if engine_name == "chatpipe":  # the intake modes do not depend on the engine
        print(f"skewed load ({n_skew} requests, 80% on 2 conversations, 2 workers, 1 thread each):")
        t_part = skewed_load(fresh_kafka(bootstrap), tmp, "partition", n_skew, 16)
        t_share = skewed_load(fresh_kafka(bootstrap), tmp, "share", n_skew, 16)
        print(f"  share finishes the load {t_part / t_share:.2f}x as fast as partition")
    print(f"worker/kafka+worker vs engine tokens/s ratio = {k_rate / e_rate:.2f}")


def make_copy(req, tag: str):
    """The same request under a fresh id (Kafka side of a pair)."""
    import dataclasses

    return dataclasses.replace(req, request_id=f"{req.request_id}-{tag}")


if __name__ == "__main__":
    main()
