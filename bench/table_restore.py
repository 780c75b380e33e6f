"""How long ``chatpipe streams`` takes to restore its conversation table from the changelog at start.

The table lives in memory (``store="memory://"``) and is read back whole from its compacted changelog
topic on every start, before any prompt is served; idle expiry (``streams/expiry.py``) bounds how many
conversations that is, not how fast they load. This script writes N conversation states straight to the
changelog of a fresh topic prefix (Faust's own encoding: JSON key and value; each conversation with
``--turns`` turns in its recent window and as many recorded request ids, built with ``streams/state.py``),
then starts the real ``chatpipe streams`` on it and times, from the process start, "Recovery complete"
(Faust's table restore done) and "Ready". The baseline, same script and broker: the same start on an empty
changelog. The restore's own cost is the difference; it is also set against reading the same records with
a plain consumer (the broker's part of it).

    python bench/table_restore.py --quick   # 20k conversations, about a minute on 2 cores
    python bench/table_restore.py           # 100k, and the 1M figure extrapolated from it

The last line is the headline: the start with N conversations over the empty start.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from confluent_kafka.admin import NewTopic

from chatpipe.testing.streams import StreamsWorker
from local_broker import bench_broker, bench_parser, fresh_kafka  # bench/, beside this script
from schemas.topics import spec
from streams.app import CHANGELOG_ERASURE_CONFIG, changelog_topic
from streams.settings import StreamsSettings
from streams.state import ConversationState, RecentTurn
from transport import clients as kafka_clients

PROMPT = "Could you remind me what we said about the lighthouse keeper's schedule last week? " * 2
ANSWER = "You said the keeper climbs at dusk, checks the lamp twice a night and logs the weather at dawn. " * 3


def conversation(i: int, turns: int) -> ConversationState:
    state = ConversationState(tenant="bench", user_id=f"user-{i % 5000}", conversation_id=f"conv-{i}")
    now = int(time.time() * 1000)
    for t in range(turns):
        request_id = uuid.uuid4().hex
        turn = RecentTurn(turn_id=str(uuid.uuid4()), turn_index=t, prompt=PROMPT, answer=ANSWER, created_at=now)
        state.record(request_id, turn, tokens_in=60, tokens_out=70, window=turns, dedupe_window=256)
    state.active_at = now
    return state


def write_changelog(bootstrap: str, topic: str, partitions: int, count: int, turns: int) -> int:
    """``count`` conversation states on ``topic`` as Faust's json serializer writes them; their bytes."""
    producer = kafka_clients.raw_producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "acks": "all",
                                           "compression.type": "lz4", "batch.size": 1 << 20})
    written = 0
    for i in range(count):
        state = conversation(i, turns)
        key, value = json.dumps(state.key).encode(), json.dumps(state.to_value()).encode()
        while True:
            try:
                producer.produce(topic, value, key=key, partition=i % partitions)
                break
            except BufferError:
                producer.poll(0.1)
        written += len(key) + len(value)
        producer.poll(0)
    producer.flush(120)
    return written


def read_all(bootstrap: str, topic: str, partitions: int, count: int) -> float:
    """Seconds a plain consumer takes to read ``count`` records of ``topic`` from the start."""
    consumer = kafka_clients.raw_consumer({"bootstrap.servers": bootstrap, "group.id": f"restore-{uuid.uuid4().hex}",
                                           "enable.auto.commit": False})
    started, seen = time.perf_counter(), 0
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])  # as Faust's restore
    try:
        while seen < count:
            seen += sum(1 for m in consumer.consume(10_000, 1.0) if m.error() is None)
            if time.perf_counter() - started > 600:
                raise SystemExit(f"read only {seen} of {count} records of {topic} in 600 s")
        return time.perf_counter() - started
    finally:
        consumer.close()


def start_times(kafka, root: Path, changelog: str) -> tuple[float, float, int, float]:
    """Seconds from ``chatpipe streams``' start to "Recovery complete" and to "Ready", the records Faust's
    recovery had to read of ``changelog`` (its "Highwater for active changelog partitions" table) and the
    process's resident memory once ready (MiB)."""
    root.mkdir(parents=True)
    worker = StreamsWorker(kafka, root)
    started = time.perf_counter()
    worker.start(timeout_s=1200)
    ready = time.perf_counter() - started
    log = worker.current_log()
    status = Path(f"/proc/{worker.proc.pid}/status").read_text()
    rss_mib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 1024
    worker.stop()
    # Faust logs with millisecond timestamps: the restore's end relative to Ready, from the log itself.
    stamps = {}
    for line in log.splitlines():
        for mark in ("Recovery complete", "[^Worker]: Ready"):
            if mark in line and mark not in stamps:
                stamps[mark] = time.mktime(time.strptime(line[1:20], "%Y-%m-%d %H:%M:%S")) + int(line[21:24]) / 1e3
    if len(stamps) < 2:
        raise SystemExit(f"no 'Recovery complete' / 'Ready' in the streams log:\n{worker.tail()}")
    recovered = ready - (stamps["[^Worker]: Ready"] - stamps["Recovery complete"])
    return recovered, ready, _records_to_restore(log, changelog), rss_mib


def _records_to_restore(log: str, changelog: str) -> int:
    """The sum of (last offset + 1) over the rows of Faust's "Highwater for active changelog partitions"
    table: "| <topic> | <partition> | <highwater> |", the topic written once, then a ditto mark."""
    lines = log.splitlines()
    starts = [i for i, line in enumerate(lines) if "Highwater for active changelog partitions" in line]
    total, topic = 0, None
    for line in lines[starts[-1] + 1:] if starts else []:
        if line.startswith("+") and topic is not None:
            break  # the table's last border
        cells = [cell.strip() for cell in line.split("|")]
        if len(cells) == 5 and cells[3].lstrip("-").isdigit():
            topic = cells[1] if cells[1] != "\u3003" else topic
            total += int(cells[3]) + 1 if topic == changelog else 0
    return total


def main() -> None:
    parser = bench_parser(__doc__.split("\n")[0], "20k conversations, about a minute on 2 cores")
    parser.add_argument("--conversations", type=int, default=None, help="default 100,000 (--quick: 20,000)")
    parser.add_argument("--turns", type=int, default=8, help="turns in each conversation's recent window")
    args = parser.parse_args()
    count = args.conversations or (20_000 if args.quick else 100_000)

    with bench_broker(args.bootstrap_servers, prefix="chatpipe-bench-restore-") as bootstrap, \
            tempfile.TemporaryDirectory(prefix="chatpipe-bench-restore-") as scratch:
        empty, full = fresh_kafka(bootstrap, "re"), fresh_kafka(bootstrap, "rf")
        topic = changelog_topic(full, StreamsSettings())
        partitions = spec("chat.prompts").partitions
        # As Faust declares it (compacted, the erasure settings); Faust finds it there and reads it back.
        admin = kafka_clients.raw_admin({"bootstrap.servers": bootstrap})
        config = {"cleanup.policy": "compact", **CHANGELOG_ERASURE_CONFIG}
        admin.create_topics([NewTopic(topic, partitions, 1, config=config)])[topic].result()
        began = time.perf_counter()
        size = write_changelog(bootstrap, topic, partitions, count, args.turns)
        print(f"wrote {count:,} conversation states ({args.turns} turns each, {size / count / 1024:.1f} KiB each, "
              f"{size / 2**20:.0f} MiB) to {topic} in {time.perf_counter() - began:.1f} s")
        raw_s = read_all(bootstrap, topic, partitions, count)
        print(f"a plain consumer reads them in {raw_s:.1f} s")
        base_recovered, base_ready, _, base_rss = start_times(empty, Path(scratch) / "empty", topic)
        print(f"empty table: Recovery complete {base_recovered:.1f} s, Ready {base_ready:.1f} s after start, "
              f"{base_rss:.0f} MiB resident")
        recovered, ready, restored, rss = start_times(full, Path(scratch) / "full", topic)
        print(f"{count:,} conversations: Recovery complete {recovered:.1f} s, Ready {ready:.1f} s after start, "
              f"{rss:.0f} MiB resident (Faust's recovery read {restored:,} records of the changelog)")
        if restored < count:
            raise SystemExit(f"the restore read {restored:,} records, not the {count:,} written: nothing to time")
        restore = max(0.0, recovered - base_recovered)
        per_100k = restore * 100_000 / count
        per_100k_mib = (rss - base_rss) * 100_000 / count
        print(f"the restore itself: {restore:.1f} s ({per_100k:.1f} s and {per_100k_mib:.0f} MiB per 100k conversations, "
              f"{restore / raw_s:.1f}x the plain read); 1M conversations, extrapolated linearly: "
              f"{base_ready + 10 * per_100k:.0f} s to Ready, {(base_rss + 10 * per_100k_mib) / 1024:.1f} GiB resident")
        print(f"table_restore/{count // 1000}k conversations: start over the empty start = {ready / base_ready:.2f}x")


if __name__ == "__main__":
    main()
