"""The capacity simulation against a measured run: 1, then 2 real inference workers under the same load.

Everything the simulation is given is measured in the same run; nothing of the runs it predicts
goes in but the load itself (arrival times, partitions, answer lengths):

1. **Per-worker curve**: ``chatpipe inference`` processes (chatpipe/testing/worker.py ``start_worker``,
   1 torch thread, engine max batch 4, the default model on CPU), fed ``InferenceRequest``s straight on
   ``chat.inference.requests`` (the streams tier and the gateway are skipped: the worker count changes
   neither). Worker A in a closed loop at k = 1, 2, (3,) 4 requests in flight: output tokens/s over a
   window, counted token by token from the ``TokenChunk``s' worker timestamps. The rounds are spread
   over the script (before run 1, between the runs, after run 2; once B is in the group on A's
   partitions only, B idle), and the curve is the median per k: the machine is shared, and other jobs
   come and go. Around each window a busy-loop probe measures the share of a core one more
   single-threaded process gets (``probe_cpu``); the curve is kept per whole core too.
   Also measured: a worker's start (process start to SERVING: the pod start of the simulation) and the
   second worker's join (SERVING to its first answer: the rebalance).
2. **The load**: a backlog of B requests at t = 0, then lambda requests/s for T seconds, sized from the
   first round (lambda = one worker's capacity, B = 1.5 x lambda x T), keys spread evenly over the 6
   partitions (conversation ids picked by their murmur2 partition), prompts of ~70 tokens
   (LMSYS-Chat-1M's mean), greedy, ``max_tokens`` 32 (full: 48) so a run fits minutes.
3. **Run 1**: worker A alone. **Run 2**: worker B joins A's consumer group, both answer, then the same
   load again (fresh ids, another tenant: no prefix-cache reuse across runs). The probe runs before
   and after each run with as many busy loops as workers.
4. **Prediction**: ``capacity.simulate`` with 1 and 2 workers ready, the runs' own arrival offsets,
   partitions and answer lengths (``Response.tokens_out``), and a per-worker speed of the whole-core
   curve x the CPU share the probe found for that run (the headline). The same with the median curve
   as measured (no probe) is printed beside it.

Error definition: per run, |simulated - measured| / measured of the **drain time** (first request
produced to last answer, the answers' ``completed_at``); the headline is the larger of the two runs.
Queue wait p50 / p99 (``Response.queue_ms``: produced to engine admission) and the 1 -> 2 speedup are
printed with their own errors. Also measured here, for ``capacity/figures.py``: the encoded sizes of
the pipeline's records and the archive's bytes per turn (``capacity/records.py``, on the model's own
answers), and the broker's CPU per million token chunks (``--skip-broker`` leaves it out).

Starts its own broker (bench/local_broker.py) unless ``--bootstrap-servers`` is given. The last line:
``capacity/simulation vs measured 1->2 workers error = X%``.

    python bench/capacity.py --quick     # ~5 minutes on 2 CPU cores
    python bench/capacity.py             # the docs/deploy.md figures (~11 minutes)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from local_broker import bench_broker, bench_parser, broker_pid, cpu_of, cpu_s, cpu_since, fresh_kafka  # bench/, beside this script

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from capacity.simulate import Curve, WorkerParams, percentile, simulate
from capacity.traffic import Request
from chatpipe.testing.worker import Reader, WorkerProcess, make_request, send_requests, start_worker
from schemas.codec import default_codec
from schemas.records import InferenceRequest, TokenChunk, now_ms
from schemas.topics import REPLIES
from transport import clients as kafka_clients
from transport.partitioning import LIBRDKAFKA_PARTITIONER, partition_of

PARTITIONS = 6
MAX_BATCH = 4
WORKER_ENV = {"CHATPIPE_NUM_THREADS": "1", "CHATPIPE_MAX_BATCH": str(MAX_BATCH), "CHATPIPE_KV_CACHE_TOKENS": "4096",
              "CHATPIPE_MAX_SEQ_LEN": "512", "CHATPIPE_DEVICE": "cpu"}
TOPICS = ("a city's history", "how bridges carry load", "the life of bees", "why the sky is blue",
          "the first computers", "how bread rises", "ocean tides", "the rules of chess", "volcanoes",
          "how vaccines train the body", "the printing press", "migrating birds", "black holes",
          "coffee farming", "how rivers shape valleys", "the violin", "glaciers", "early aviation")


def prompt_text(i: int) -> str:
    """A prompt of about 70 tokens (LMSYS-Chat-1M's mean user prompt), different for every i."""
    topic = TOPICS[i % len(TOPICS)]
    return (f"Request {i}. I am preparing a short talk for a group of curious students about {topic}. "
            f"Please write a long, detailed and friendly explanation of {topic}, with a few concrete examples, "
            f"some surprising facts, and a short story that makes the idea easy to remember. Use plain words, "
            f"full sentences, and do not stop early.")


def balanced_keys(n: int, tag: str, partitions: tuple[int, ...] = tuple(range(PARTITIONS))) -> list[str]:
    """n conversation ids whose murmur2 partitions go round ``partitions`` in turn."""
    keys, j = [], 0
    for i in range(n):
        want = partitions[i % len(partitions)]
        while partition_of(key := f"{tag}-{i}-{j}", PARTITIONS) != want:
            j += 1
        keys.append(key)
    return keys


PROBE = ("import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"
         "print(time.process_time() / {s})")


def probe_cpu(threads: int, seconds: float = 2.0) -> float:
    """The share of a core each of ``threads`` busy processes gets right now (0..1): what the machine has
    left for that many single-threaded workers while other jobs run on it. Measured by busy loops, not
    by the runs: the simulation's per-worker speed is scaled by it (docs/deploy.md "Autoscaling")."""
    import subprocess

    procs = [subprocess.Popen([sys.executable, "-S", "-I", "-c", PROBE.format(s=seconds)], stdout=subprocess.PIPE,
                              text=True) for _ in range(threads)]
    shares = [float(p.communicate()[0].strip() or "nan") for p in procs]
    return min(1.0, statistics.fmean(shares))


class Load:
    """Makes and sends the bench's requests."""

    def __init__(self, kafka, max_tokens: int) -> None:
        from chatpipe.testing.kafka import RecordWriter

        self.kafka = kafka
        self.max_tokens = max_tokens
        self.producer = RecordWriter(kafka, extra_config={"linger.ms": 0})

    def request(self, i: int, key: str, tenant: str, max_tokens: int | None = None) -> InferenceRequest:
        """A greedy, interactive request of ``prompt_text(i)`` (a tenant of its own: no prefix-cache reuse
        across tenants), answered on the reply topic."""
        return make_request(i, conversation=key, tenant=tenant, max_tokens=max_tokens or self.max_tokens,
                            reply_to=self.kafka.topic(REPLIES), reply_partition=i % PARTITIONS, text=prompt_text(i))

    def send(self, *requests: InferenceRequest) -> None:
        send_requests(self.kafka, list(requests), self.producer)  # on the broker now: the schedule is the arrival time


def closed_loop(load: Load, reader: Reader, k: int, window_s: float, tag: str,
                partitions: tuple[int, ...] = tuple(range(PARTITIONS))) -> tuple[float, float]:
    """(output tokens/s, mean output tokens) with k requests always in flight, over ``window_s``, on
    ``partitions`` (those of one worker when two are in the group: the other one stays idle)."""
    keys = balanced_keys(400, f"{tag}-k{k}", partitions)
    sent: list[str] = []  # request ids; the next request is number len(sent)
    answered = lambda: sum(1 for r in sent if r in reader.seen.responses)

    def top_up() -> None:
        while len(sent) - answered() < k:
            req = load.request(len(sent), keys[len(sent) % len(keys)], tenant=f"{tag}k{k}")
            load.send(req)
            sent.append(req.request_id)

    top_up()
    warm_until = None
    while warm_until is None:  # warm: the first k answers (the batch is staggered after them)
        reader.poll(0.05)
        top_up()
        if answered() >= k:
            warm_until = now_ms()
    end_ms = warm_until + window_s * 1000
    while now_ms() < end_ms + 500:
        reader.poll(0.05)
        top_up()
    ours = set(sent)
    reader.wait_responses(ours, 300)  # the worker idle again before anything else (the CPU probe) is measured
    tokens = sum(len(chunk.token_ids) for rid in ours for chunk, _ in reader.seen.chunks.get(rid, ())
                 if warm_until <= chunk.created_at < end_ms)
    done = [reader.seen.first_response(r)[0].tokens_out for r in ours if r in reader.seen.responses]
    return tokens / window_s, statistics.fmean(done)


@dataclass
class RunResult:
    requests: list[InferenceRequest]
    responses: list
    produced_ms: list[int]
    cpu: dict[str, float]
    load_avg: tuple[float, float]
    share: float = 1.0  # CPU each worker could get (busy-loop probe before and after the run)

    @property
    def t0(self) -> int:
        return min(self.produced_ms)

    def drain_s(self) -> float:
        return (max(r.completed_at for r in self.responses) - self.t0) / 1000

    def queue_waits(self) -> list[float]:
        return [r.queue_ms / 1000 for r in self.responses]

    def as_sim_requests(self) -> list[Request]:
        return [Request(i, (p - self.t0) / 1000, i % PARTITIONS, resp.tokens_in, resp.tokens_out)
                for i, (p, resp) in enumerate(zip(self.produced_ms, self.responses))]


def open_loop(load: Load, reader: Reader, backlog: int, rate: float, steady_s: float, tag: str,
              pids: dict[str, int]) -> RunResult:
    """The fixed load: ``backlog`` at t = 0, then ``rate``/s for ``steady_s`` (a fixed schedule)."""
    n = backlog + round(rate * steady_s)
    keys = balanced_keys(n, tag)
    schedule = [0.0] * backlog + [(j + 1) / rate for j in range(n - backlog)]
    cpu0 = cpu_of(pids)
    requests = []
    start = time.monotonic()
    for i, at in enumerate(schedule):
        while (wait := start + at - time.monotonic()) > 0:
            reader.poll(min(wait, 0.05))
        req = load.request(i, keys[i], tenant=tag)
        load.send(req)
        requests.append(req)
    reader.wait_responses([r.request_id for r in requests], 900)
    cpu = cpu_since(pids, cpu0)
    return RunResult(requests, [reader.seen.first_response(r.request_id)[0] for r in requests],
                     [r.enqueued_at for r in requests], cpu, os.getloadavg()[:2])


def predict(run: RunResult, curve: Curve, workers: int):
    return simulate(run.as_sim_requests(), WorkerParams(curve, max_batch=MAX_BATCH), partitions=PARTITIONS,
                    replicas=workers)


def rel(a: float, b: float) -> float:
    return abs(a - b) / b if b else float("nan")


def main() -> None:
    parser = bench_parser(__doc__, "about five minutes on 2 cores")
    parser.add_argument("--skip-broker", action="store_true", help="skip the broker CPU measurement")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this file")
    args = parser.parse_args()
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped bench still stops its workers and broker
    with bench_broker(args.bootstrap_servers, prefix="chatpipe-bench-capacity-") as bootstrap:
        run(bootstrap, args.quick, args.skip_broker or args.bootstrap_servers is not None, args.json)


def run(bootstrap: str, quick: bool, skip_broker: bool, json_out: Path | None) -> None:
    max_tokens, window_s, ks, steady_s, rounds = ((32, 8.0, (1, 2, 4), 20.0, 2) if quick
                                                  else (48, 12.0, (1, 2, 3, 4), 40.0, 3))
    tmp = Path(tempfile.mkdtemp(prefix="chatpipe-bench-capacity-logs-"))
    kafka = fresh_kafka(bootstrap, "cap")
    bpid = broker_pid(bootstrap)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; broker pid {bpid}; "
          f"workers: 1 torch thread, max batch {MAX_BATCH}, max_tokens {max_tokens}")
    figures: dict[str, object] = {"quick": quick, "max_batch": MAX_BATCH, "max_tokens": max_tokens}

    workers: list[WorkerProcess] = []  # terminated at the end

    def start(worker_id: str) -> tuple[WorkerProcess, float]:
        """A worker of WORKER_ENV, SERVING, and the seconds it took to get there (the pod start of the simulation)."""
        t = time.monotonic()
        workers.append(start_worker(kafka, tmp, worker_id=worker_id, **WORKER_ENV))
        workers[-1].wait_serving(300)
        return workers[-1], time.monotonic() - t

    a, start_a = start("cap-a")
    reader = Reader(kafka)
    load = Load(kafka, max_tokens)
    try:
        warm = [load.request(10_000 + j, k, "warm") for j, k in enumerate(balanced_keys(6, "warm"))]
        load.send(*warm)
        reader.wait_responses([r.request_id for r in warm], 300)
        print(f"\n1. per-worker curve of worker A (closed loop, {window_s:.0f} s windows, k = {ks}); rounds before run 1"
              f"{', between the runs' if rounds == 3 else ''} and after run 2 (then on A's partitions only, B idle); "
              f"worker start to SERVING {start_a:.1f} s")
        measured: dict[int, list[float]] = {k: [] for k in ks}
        per_core: dict[int, list[float]] = {k: [] for k in ks}
        shares: dict[int, list[float]] = {k: [] for k in ks}
        mean_out: list[float] = []

        def curve_round(tag: str, partitions: tuple[int, ...] = tuple(range(PARTITIONS))) -> None:
            for k in ks:  # the k alternate within a round, the rounds spread over the script: medians
                before = probe_cpu(1)
                rate, mean = closed_loop(load, reader, k, window_s, tag, partitions)
                share = (before + probe_cpu(1)) / 2
                measured[k].append(rate)
                per_core[k].append(rate / share)
                shares[k].append(share)
                mean_out.append(mean)
            print(f"   round {tag}: " + ", ".join(f"k={k} {measured[k][-1]:.1f}" for k in ks)
                  + f" tokens/s; CPU left for one worker {statistics.fmean(shares[k][-1] for k in ks):.2f}; "
                  f"load average {os.getloadavg()[0]:.1f}")

        curve_round("r0")
        first = Curve(tuple((k, measured[k][0]) for k in ks))
        rate = first.rate(MAX_BATCH) / statistics.fmean(mean_out)  # one worker's capacity (round 0): sizes the load
        backlog = round(1.5 * rate * steady_s)
        print(f"\n2. the load (sized from round r0): {backlog} requests at t=0, then {rate:.2f}/s for {steady_s:.0f} s "
              f"({backlog + round(rate * steady_s)} requests)")

        before = probe_cpu(1)
        run1 = open_loop(load, reader, backlog, rate, steady_s, "run1", {"worker A": a.proc.pid, "broker": bpid or 0})
        run1.share = (before + probe_cpu(1)) / 2
        print(f"   run 1 (1 worker): drain {run1.drain_s():.1f} s, CPU s {fmt_cpu(run1.cpu)}, load average "
              f"{run1.load_avg[0]:.1f}")

        b, start_b = start("cap-b")
        serving_b = time.monotonic()
        join_b = None
        owner: dict[int, str] = {}
        j = 0
        while len(set(owner.values())) < 2 and time.monotonic() - serving_b < 120:
            batch = [load.request(20_000 + j + n, k, "join", max_tokens=2) for n, k in enumerate(balanced_keys(6, f"join{j}"))]
            j += 6
            load.send(*batch)
            reader.wait_responses([r.request_id for r in batch], 120)
            owner = {n % PARTITIONS: reader.seen.first_response(r.request_id)[0].worker_id for n, r in enumerate(batch)}
            if "cap-b" in owner.values() and join_b is None:
                join_b = time.monotonic() - serving_b
        a_parts = tuple(sorted(p for p, w in owner.items() if w == "cap-a"))
        print(f"   worker B: start to SERVING {start_b:.1f} s, SERVING to its first answer {join_b or float('nan'):.1f} s; "
              f"A owns partitions {a_parts}")
        if rounds == 3:
            curve_round("r1", a_parts)

        before = probe_cpu(2)
        run2 = open_loop(load, reader, backlog, rate, steady_s, "run2",
                         {"worker A": a.proc.pid, "worker B": b.proc.pid, "broker": bpid or 0})
        run2.share = (before + probe_cpu(2)) / 2
        split = dict(Counter(resp.worker_id for resp in run2.responses))
        print(f"   run 2 (2 workers): drain {run2.drain_s():.1f} s, answered per worker {split}, "
              f"CPU s {fmt_cpu(run2.cpu)}, load average {run2.load_avg[0]:.1f}")
        curve_round(f"r{rounds - 1}", a_parts)

        points = [(k, statistics.median(measured[k])) for k in ks]
        core_points = [(k, statistics.median(per_core[k])) for k in ks]
        print("\n   the curve (medians of the rounds):")
        for (k, r), (_, full) in zip(points, core_points):
            print(f"   k={k}: {r:6.1f} output tokens/s ({r / k:5.1f} per request; rounds "
                  f"{', '.join(f'{x:.1f}' for x in measured[k])}); CPU left for one worker "
                  f"{', '.join(f'{x:.2f}' for x in shares[k])} -> {full:6.1f} tokens/s on a whole core")
        curve = Curve(tuple(points), label="this run")
        core_curve = Curve(tuple(core_points), label="this run, per whole core")
        out_mean = statistics.fmean(mean_out)
        print(f"   answers {out_mean:.1f} tokens on average (the runs' own lengths go to the simulation)")
        answers = [got[0][0].text for got in reader.seen.responses.values()
                   if got[0][0].tokens_out > 4]  # not the 2-token joins
        prompts = [prompt_text(i) for i in range(len(TOPICS) * 3)]
    finally:
        reader.close()
        for w in workers:
            w.terminate()

    print(f"\n3. simulation vs measured: the median curve of step 1, the runs' arrivals, partitions and answer lengths; "
          f"CPU left per worker (probe): run 1 {run1.share:.2f}, run 2 {run2.share:.2f}")
    detail: dict[str, list] = {}
    tables = {}
    for how, curve_for in (("as probed", lambda run_: core_curve.scaled(run_.share)),
                           ("unscaled", lambda run_: curve)):
        rows = []
        for name, run_, n in (("1 worker", run1, 1), ("2 workers", run2, 2)):
            sim = predict(run_, curve_for(run_), n)
            if how == "as probed":
                detail[name] = [{"arrival_s": (p - run_.t0) / 1000, "queue_s": r.queue_ms / 1000,
                                 "total_s": r.total_ms / 1000, "done_s": (r.completed_at - run_.t0) / 1000,
                                 "tokens_out": r.tokens_out, "worker": r.worker_id, "sim_start_s": st, "sim_done_s": dn}
                                for p, r, st, dn in zip(run_.produced_ms, run_.responses, sim.start, sim.done)]
            m_q, s_q = run_.queue_waits(), sim.queue_waits()
            rows.append((name, run_.drain_s(), sim.drain_s(), percentile(m_q, .5), percentile(s_q, .5),
                         percentile(m_q, .99), percentile(s_q, .99)))
        tables[how] = rows
        label = ("per-worker speed = the whole-core curve x the CPU the probe found for each worker (the headline)"
                 if how == "as probed" else "per-worker speed = the curve as measured (as if each worker got the same "
                 "CPU as in step 1)")
        print(f"   {label}:")
        print(f"   {'':10} {'drain s (meas / sim / err)':>28} {'queue wait p50 s':>22} {'queue wait p99 s':>22}")
        for name, md, sd, m50, s50, m99, s99 in rows:
            print(f"   {name:10} {md:8.1f} / {sd:6.1f} / {rel(sd, md):5.1%}   {m50:6.1f} / {s50:5.1f} "
                  f"({rel(s50, m50):5.1%})   {m99:6.1f} / {s99:5.1f} ({rel(s99, m99):5.1%})")
        m_speed, s_speed = rows[0][1] / rows[1][1], rows[0][2] / rows[1][2]
        print(f"   speedup 1 -> 2 workers (drain 1 / drain 2): measured {m_speed:.2f}x, simulated {s_speed:.2f}x "
              f"({rel(s_speed, m_speed):.1%})")
    # Diagnostic, not a prediction: the same with the CPU each worker did get during the run (/proc), which
    # splits the error into the model's (batching, queueing, partitions) and the probe's (the machine's speed).
    got = []
    for run_, n, names in ((run1, 1, ("worker A",)), (run2, 2, ("worker A", "worker B"))):
        share = sum(run_.cpu[name] for name in names) / n / run_.drain_s()
        sim = predict(run_, core_curve.scaled(share), n)
        got.append((share, rel(sim.drain_s(), run_.drain_s())))
    print(f"   diagnostic: CPU the workers got (from /proc) {got[0][0]:.2f} and {got[1][0]:.2f} per worker (the probe "
          f"said {run1.share:.2f}, {run2.share:.2f}); with it the drain errors would be {got[0][1]:.1%} and "
          f"{got[1][1]:.1%}")
    # the larger drain error of the two runs, with and without the probe
    error, raw_error = (max(rel(sd, md) for _, md, sd, *_ in tables[how]) for how in ("as probed", "unscaled"))
    rows = tables["as probed"]
    m_speed, s_speed = rows[0][1] / rows[1][1], rows[0][2] / rows[1][2]

    from transformers import AutoTokenizer

    from capacity.records import measure_record_sizes
    from inference.engine.settings import EngineSettings

    tokenizer = AutoTokenizer.from_pretrained(EngineSettings(device="cpu").default_model_dir())
    sizes = measure_record_sizes(prompts, answers, lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    print("\n4. record sizes (the codec; archive = Avro container, deflate, as transport/archive.py writes it), "
          "LMSYS-shaped turns built from this run's answers:")
    for name, value in sizes.items():
        print(f"   {name}: {value:,.1f}")
    figures.update(curve=points, core_curve=core_points, shares=shares,
                   run_shares=[run1.share, run2.share], answer_tokens=out_mean, worker_start_s=[start_a, start_b],
                   join_s=join_b, tables=tables, error=error, raw_error=raw_error, sizes=sizes, cpu_got=got,
                   speedup=[m_speed, s_speed], cpu=[run1.cpu, run2.cpu], requests=detail)
    if not skip_broker and bpid:
        figures["broker"] = broker_cost(kafka, bpid, quick)
    if json_out:
        json_out.write_text(json.dumps(figures, indent=2, default=str))
    print(f"\nthe same without the probe (each worker as fast as in step 1): error = {raw_error:.1%}")
    print(f"capacity/simulation vs measured 1->2 workers error = {error:.1%}")


def fmt_cpu(cpu: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())


def broker_cost(kafka, bpid: int, quick: bool) -> dict[str, float]:
    """Broker CPU-seconds per million token chunks produced (lz4 batches, as the workers send them) and
    per million read back by one consumer: the broker-side figure behind ``chatpipe capacity``'s brokers."""
    n = 200_000 if quick else 600_000
    codec = default_codec()
    value = codec.encode(TokenChunk(request_id=str(uuid.uuid4()), conversation_id=str(uuid.uuid4()), index=117,
                                    text=" word", token_ids=[1234], worker_id="worker-7f9c2"))
    topic = kafka.topic(REPLIES)
    producer = kafka_clients.producer(kafka, {"linger.ms": 5, "compression.type": "lz4", "acks": "all",
                         "enable.idempotence": True, "partitioner": LIBRDKAFKA_PARTITIONER})
    c0, t0 = cpu_s(bpid), time.monotonic()
    for i in range(n):
        while True:
            try:
                producer.produce(topic, value, partition=i % PARTITIONS)
                break
            except BufferError:
                producer.poll(0.05)
        if i % 1000 == 0:
            producer.poll(0)
    producer.flush(60)
    produce_cpu, produce_wall = cpu_s(bpid) - c0, time.monotonic() - t0
    consumer = kafka_clients.consumer(kafka, f"cap-broker-{uuid.uuid4().hex[:6]}",
                                      {"enable.auto.commit": False, "auto.offset.reset": "earliest"})
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
    c0, t0, got = cpu_s(bpid), time.monotonic(), 0
    while got < n and time.monotonic() - t0 < 120:
        got += sum(1 for m in consumer.consume(10_000, 1.0) if not m.error())
    consume_cpu, consume_wall = cpu_s(bpid) - c0, time.monotonic() - t0
    consumer.close()
    out = {"records": n, "record_bytes": len(value),
           "produce_broker_cpu_s_per_million": produce_cpu / n * 1e6, "produce_records_per_s": n / produce_wall,
           "consume_broker_cpu_s_per_million": consume_cpu / got * 1e6 if got else float("nan"),
           "consume_records_per_s": got / consume_wall}
    print(f"\n5. broker CPU per million token chunks ({len(value)} B each, lz4, linger 5 ms): produced "
          f"{out['produce_broker_cpu_s_per_million']:.2f} s ({out['produce_records_per_s']:,.0f}/s), "
          f"read back {out['consume_broker_cpu_s_per_million']:.2f} s ({out['consume_records_per_s']:,.0f}/s)")
    return out


if __name__ == "__main__":
    main()
