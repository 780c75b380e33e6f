"""The streams intake, batched vs one prompt at a time; and the memory figures behind it.

(1) **intake prompts/s, batched vs one at a time.** The same prompts (``--prompts`` of them, over
``--users`` users, each user with remembered turns so recall finds something) are produced to
``chat.prompts`` of one broker at once, after the worker has served ``2 x batch`` warm-up prompts
(the first model calls of each input shape are slow), so intake works through a backlog. The
real ``chatpipe streams`` worker serves them twice, in fresh topic namespaces and fresh Qdrant
folders holding the same remembered turns: once with ``CHATPIPE_STREAMS_INTAKE_BATCH_SIZE=1`` (every prompt embedded,
recalled and produced on its own) and once with the default batch (one embedding call and one
recall call per batch). Throughput counts from the moment the backlog is produced to the last
``InferenceRequest``'s ``enqueued_at`` (stamped by intake); the worker is already up and warm, so
its start-up is not in it, and the first batch's work is. Goal >= 5x.
The worker runs with torch's default threads on both sides, as it does in service
(``--torch-threads N`` pins N; on a 2-core machine shared with other work, 1 is steadier: torch's
2 threads then stall on each other's barriers and make a batch slower than single texts).

(1b) **2 streams workers vs 1** (batched): the same backlog served by one ``chatpipe streams`` and by
two in one Faust group (each its own state folder; the web server is off by default, so no port),
both sides on one real Qdrant server (``../shared/tools/qdrant``, started here; memory must be shared
between workers), the backlog produced once the group is stable and both are warm. Each worker gets
its share of the cores for torch (``cores // workers`` threads, unless ``--torch-threads``). On a
2-core machine little is to be gained (the two compete for the same cores; the point of several
workers is exactness and fail-over, and the figure says what it costs). Skipped without the server.

(2) **embed+upsert turns/s vs raw sentence-transformers encoding** and (3) **recall p99 at 100k
stored turns** (local mode) are the memory engineer's measurements, called from
``bench/memory.py`` (``measure_embed_upsert``, ``measure_recall_latency``).

``python bench/intake.py [--quick] [--skip-scaling]``; the last line is the intake ratio. The broker, the worker
and this script share the machine's cores: figures measured while other work runs are noisy.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from local_broker import bench_broker, bench_parser, fresh_kafka  # noqa: E402 - bench/, beside this script

from chatpipe.testing.kafka import RecordWriter  # noqa: E402 - sys.path set above so the script runs from a clone
from chatpipe.testing.processes import start_process  # noqa: E402 - sys.path set above so the script runs from a clone
from chatpipe.testing.streams import Tap  # noqa: E402 - sys.path set above so the script runs from a clone
from schemas.records import ChatMessage, PromptRequest, SamplingParams  # noqa: E402 - sys.path set above so the script runs from a clone
from transport.settings import KafkaSettings  # noqa: E402 - sys.path set above so the script runs from a clone

TORCH_THREADS: int | None = None  # set from --torch-threads; the same for both sides

SUBJECTS = ["my garden", "the train schedule", "a birthday present", "learning Spanish", "the quarterly report",
            "my bike", "a recipe for soup", "the new laptop", "a trip to Lisbon", "my sleep schedule"]


def prompts_for(n: int, users: int, seed: int) -> list[PromptRequest]:
    out = []
    for i in range(n):
        u = (i * 7 + seed) % users
        subject = SUBJECTS[(i + u) % len(SUBJECTS)]
        out.append(PromptRequest(
            conversation_id=f"conv{u}", user_id=f"user{u}", tenant=f"tenant{u % 5}", model="smollm2",
            messages=[ChatMessage("user", f"Question {i}: what should I do next about {subject}? "
                                          "Please keep it short and practical.")],
            sampling=SamplingParams(max_tokens=128)))
    return out


def remembered_turns(users: int, per_user: int):
    from streams.memory import StoredTurn

    now = int(time.time() * 1000)
    return [StoredTurn(turn_id=uuid.uuid5(uuid.NAMESPACE_OID, f"{u}-{k}").hex, tenant=f"tenant{u % 5}",
                       user_id=f"user{u}", conversation_id=f"conv{u}", turn_index=k,
                       prompt=f"Earlier I asked about {SUBJECTS[(u + k) % len(SUBJECTS)]} (note {k}).",
                       answer=f"You decided to look at {SUBJECTS[(u + k) % len(SUBJECTS)]} again next week.",
                       created_at=now - (per_user - k) * 60_000)
            for u in range(users) for k in range(per_user)]


def seed_memory(settings, turns, vectors) -> None:
    from streams.memory import ConversationMemory

    memory = ConversationMemory(settings, vectors.shape[1])
    memory.upsert(turns, vectors)
    memory.close()


def run_memory(root: Path, label: str, qdrant_url: str | None):
    """(worker environment, MemorySettings) of a run's fresh memory: a local folder, or a collection of
    its own on the shared server (every worker of the run then recalls from the same points)."""
    from streams.memory_settings import MemorySettings

    if qdrant_url is None:
        folder = root / f"qdrant-{label}"
        return {"CHATPIPE_MEMORY_PATH": str(folder)}, MemorySettings(path=folder)
    collection = f"bench_{label}_{uuid.uuid4().hex[:8]}"
    return ({"CHATPIPE_MEMORY_URL": qdrant_url, "CHATPIPE_MEMORY_COLLECTION": collection},
            MemorySettings(url=qdrant_url, collection=collection))


def wait_group_stable(kafka: KafkaSettings, group: str, members: int, timeout_s: float = 180) -> None:
    """Until the Faust group has ``members`` members, is Stable and each holds partitions."""
    from confluent_kafka import ConsumerGroupState

    from transport import clients as kafka_clients

    admin = kafka_clients.admin(kafka)
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            last = admin.describe_consumer_groups([group], request_timeout=10)[group].result(timeout=10)
            if (last.state == ConsumerGroupState.STABLE and len(last.members) == members
                    and all(m.assignment.topic_partitions for m in last.members)):
                return
        except Exception:  # noqa: BLE001 - not there yet (the group forms as the workers start)
            pass
        time.sleep(0.5)
    raise SystemExit(f"group {group} not stable with {members} member(s) within {timeout_s:.0f} s: {last}")


def serve_once(bootstrap: str, root: Path, prompts: list[PromptRequest], warmup: list[PromptRequest],
               batch_size: int, turns, vectors, *, workers: int = 1, qdrant_url: str | None = None,
               label: str | None = None, timeout_s: float = 900) -> float:
    """Prompts/s of one run: ``workers`` workers (one Faust group) with intake batch size ``batch_size``.

    The workers start and the group settles, then they serve ``warmup`` (first model calls of each
    input shape are slow); then all of ``prompts`` are produced at once, so intake works through a
    backlog, and the rate is taken from the moment they are produced to the last of *their* requests.
    """
    label = label or f"b{batch_size}-w{workers}"
    kafka = fresh_kafka(bootstrap)
    memory_env, memory_settings = run_memory(root, label, qdrant_url)
    seed_memory(memory_settings, turns, vectors)
    producer = RecordWriter(kafka)
    threads = TORCH_THREADS or (max(1, (os.cpu_count() or 1) // workers) if workers > 1 else None)
    env = {**os.environ, "CHATPIPE_BOOTSTRAP_SERVERS": bootstrap, "CHATPIPE_TOPIC_PREFIX": kafka.topic_prefix,
           "CHATPIPE_STREAMS_INTAKE_BATCH_SIZE": str(batch_size), **memory_env,
           "CHATPIPE_STREAMS_LOG_LEVEL": os.environ.get("CHATPIPE_STREAMS_LOG_LEVEL", "warning"), "HF_HUB_OFFLINE": "1",
           **({"CHATPIPE_STREAMS_TORCH_THREADS": str(threads)} if threads else {})}
    requests = Tap(kafka, "chat.inference.requests")  # every partition, from the beginning
    logs = [root / f"worker-{label}-{i}.log" for i in range(workers)]
    # each its own state and archive folder; Faust's web server is off by default
    procs = [start_process([sys.executable, "-m", "chatpipe.cli", "streams"], log=log, cwd=REPO, append=False,
                           env={**env, "CHATPIPE_STREAMS_STATE_DIR": str(root / f"faust-{label}-{i}"),
                                "CHATPIPE_STREAMS_ARCHIVE_DIR": str(root / f"archive-{label}-{i}")})
             for i, log in enumerate(logs)]
    measured = {p.request_id for p in prompts}
    stamps: list[int] = []
    try:
        deadline = time.monotonic() + timeout_s
        seen = 0

        def read() -> None:
            nonlocal seen
            stopped = [i for i, proc in enumerate(procs) if proc.poll() is not None]
            if stopped or time.monotonic() > deadline:
                log = logs[stopped[0] if stopped else 0]
                raise SystemExit(f"worker ({label}) stopped or timed out ({seen} requests seen); "
                                 f"log: {log}\n{log.read_text()[-3000:]}")
            for msg in requests.consumer.consume(500, 0.5):
                if msg.error() is None:
                    seen += 1
                    request = requests.codec.decode(msg.value())
                    if request.request_id in measured:
                        stamps.append(request.enqueued_at)

        wait_group_stable(kafka, kafka.topic_prefix + "chatpipe-streams", workers)
        for p in warmup:
            producer.send(kafka.topic("chat.prompts"), p, key=p.conversation_id)
        producer.flush()
        while seen < len(warmup):
            read()
        backlog_at = time.time() * 1000  # same clock as enqueued_at (one machine)
        for p in prompts:
            producer.send(kafka.topic("chat.prompts"), p, key=p.conversation_id)
        producer.flush()
        while len(stamps) < len(prompts):
            read()
    finally:
        requests.close()
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
    # From the moment the backlog is produced to the last request: the first batch's embedding and
    # recall are in it. (Counting from the first request's stamp would leave them out, and with only
    # a few batches of 32 that flattered the batched side by up to a batch, ~25% at --quick.)
    return len(stamps) / max((max(stamps) - backlog_at) / 1000, 1e-3)


def measure_intake(bootstrap: str, n: int, users: int, per_user: int, batch: int,
                   scaling: bool) -> tuple[float, float | None]:
    """(batched / one-at-a-time ratio, 2 workers / 1 ratio or None when skipped)."""
    from streams.embeddings import Embedder, turn_text
    from streams.memory_settings import MemorySettings

    prompts = prompts_for(n, users, seed=1)
    turns = remembered_turns(users, per_user)
    vectors = Embedder(MemorySettings()).encode([turn_text(t) for t in turns])
    print(f"intake: {n} prompts over {users} users, each with {per_user} remembered turns; "
          f"worker batch 1 vs {batch}", flush=True)
    warmup = prompts_for(2 * batch, users, seed=99)
    with tempfile.TemporaryDirectory(prefix="chatpipe-bench-intake-") as tmp:
        one_rate = serve_once(bootstrap, Path(tmp), prompts, warmup, 1, turns, vectors)
        print(f"  one at a time: {one_rate:8.1f} prompts/s", flush=True)
        batched_rate = serve_once(bootstrap, Path(tmp), prompts, warmup, batch, turns, vectors)
        print(f"  batched ({batch}): {batched_rate:8.1f} prompts/s", flush=True)
        workers_ratio = measure_scaling(bootstrap, Path(tmp), prompts, warmup, batch, turns, vectors) if scaling else None
    return batched_rate / one_rate, workers_ratio


def measure_scaling(bootstrap: str, root: Path, prompts, warmup, batch: int, turns, vectors) -> float | None:
    """Batched prompts/s of 2 streams workers in one group over 1, both on one Qdrant server."""
    from chatpipe.testing.qdrant import QDRANT_TOOL, QdrantPeer

    if not QDRANT_TOOL.exists():
        print(f"  2 workers vs 1: skipped, no Qdrant server at {QDRANT_TOOL} (workers must share memory)")
        return None
    peer = QdrantPeer(root, "qdrant-server")
    peer.start()
    try:
        peer.wait_ready()
        rates = {}
        for workers in (1, 2):
            rates[workers] = serve_once(bootstrap, root, prompts, warmup, batch, turns, vectors, workers=workers,
                                        qdrant_url=peer.url)
            threads = TORCH_THREADS or ((os.cpu_count() or 1) // workers if workers > 1 else "default")
            print(f"  batched ({batch}), {workers} worker(s), Qdrant server, torch threads {threads} each: "
                  f"{rates[workers]:8.1f} prompts/s", flush=True)
    finally:
        peer.stop()
    return rates[2] / rates[1]


def main() -> None:
    parser = bench_parser(__doc__, "a few minutes on 2 cores (four runs, five worker starts)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per run (default 600, quick 160)")
    parser.add_argument("--users", type=int, default=None, help="users (default 60, quick 30)")
    parser.add_argument("--batch", type=int, default=32, help="intake batch size of the batched run")
    parser.add_argument("--skip-memory", action="store_true", help="only the intake comparison")
    parser.add_argument("--skip-scaling", action="store_true", help="without the 2 workers vs 1 comparison")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="worker's torch threads, both sides (default 0 = torch's default). On a 2-core "
                             "machine shared with other work, 1 is steadier")
    args = parser.parse_args()
    global TORCH_THREADS
    TORCH_THREADS = args.torch_threads or None
    quick = args.quick

    if not args.skip_memory:
        try:
            from memory import measure_embed_upsert, measure_recall_latency
        except ImportError as exc:
            print(f"bench/memory.py is missing what this needs ({exc}); memory figures skipped")
        else:
            # Both print their own figures (the recall function ends with its headline line).
            embed = measure_embed_upsert(turns=256 if quick else 512, batch=64, repeats=3)
            print(embed.line(), flush=True)
            measure_recall_latency(points=20_000 if quick else 100_000, queries=300 if quick else 2000)

    with bench_broker(args.bootstrap_servers) as bootstrap:
        ratio, workers_ratio = measure_intake(bootstrap, args.prompts or (160 if quick else 600),
                                              args.users or (30 if quick else 60), per_user=10, batch=args.batch,
                                              scaling=not args.skip_scaling)
    if workers_ratio is not None:
        print(f"streams/intake 2 workers vs 1 prompts/s ratio = {workers_ratio:.2f}", flush=True)
    print(f"streams/intake batched vs one-at-a-time prompts/s ratio = {ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
