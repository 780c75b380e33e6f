"""Conversation memory speed: embed+upsert vs raw sentence-transformers, and recall latency at scale.

(a) **embed+upsert vs raw encode.** The same turn texts, in the same batches (``--batch``, the
record agent's batch size), go through (1) ``SentenceTransformer.encode`` alone, the baseline, and
(2) ``Embedder.encode`` + ``ConversationMemory.upsert`` into Qdrant local mode on disk (a fresh
store whose partitions exist, new turn ids every run). The two sides alternate batch by batch
(and which goes first alternates too), so load from other processes falls on both alike; the
headline is the median of the per-run ratios. Turns per CPU-second are printed too. Ratio =
turns/s of (2) / turns/s of (1); goal >= 0.8.

(b) **recall p99 at N stored turns, local mode.** N points with random unit vectors (recall
latency does not depend on where the vectors came from, and embedding 100k texts would take
~10 min here), spread over many tenants and users like real traffic (tenant sizes Zipf-like,
turns per user log-normal: most users have a handful, a few have hundreds), stored with the real
``ConversationMemory`` (its local partitions). Queries come from the same skewed traffic, each
filtered on tenant+user like the intake's recall. The folder is on /dev/shm when it exists, only
to make *filling* 100k points fast; recall runs from memory either way. With ``--baseline-queries`` it also times a few
recalls on one unpartitioned collection (``local_partitions=1``): the cause the partitions fix.

Importable by bench/intake.py: ``measure_embed_upsert`` and ``measure_recall_latency``.
Standalone: ``python bench/memory.py [--quick]``; the last line is the embed+upsert ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from streams.embeddings import Embedder, turn_text
from streams.memory import ConversationMemory, RecallQuery, StoredTurn
from streams.memory_settings import MemorySettings


def synthetic_turns(n: int, seed: int = 0, tenants: int = 200, start_ms: int = 1_700_000_000_000) -> list[StoredTurn]:
    """``n`` turns with chat-like texts, spread like real traffic over ``n // 10`` users.

    Tenants have Zipf-like sizes (weight ~ 1/rank^1.1: a few big customers, a long tail); each user's
    share of the turns is log-normal (sigma 1.2: most users have a handful of turns, a few have
    hundreds). Turns are interleaved in time, one second apart.
    """
    rng = np.random.default_rng(seed)
    users = max(1, n // 10)
    tenant_weights = 1.0 / np.arange(1, tenants + 1) ** 1.1
    tenant_of_user = rng.choice(tenants, size=users, p=tenant_weights / tenant_weights.sum())
    user_weights = rng.lognormal(0.0, 1.2, users)
    owner = rng.permutation(np.repeat(np.arange(users), rng.multinomial(n, user_weights / user_weights.sum())))
    topics = ["my dog", "the quarterly report", "a trip to Lisbon", "python decorators", "my sister's wedding",
              "kafka partitions", "a sourdough recipe", "the electricity bill", "learning the violin", "tax forms"]
    turns = []
    for i, u in enumerate(owner):
        topic = topics[int(rng.integers(len(topics)))]
        prompt = f"Can you help me with {topic}? I tried twice already (attempt {i}) and it still does not work."
        answer = (f"Sure. For {topic}, start with the basics, check each step, and write down what changed "
                  f"since last time. If it still fails, tell me the exact message you see on step {i % 7 + 1}.")
        turns.append(StoredTurn(turn_id=f"bench-{seed}-{i}", tenant=f"tenant{tenant_of_user[u]}", user_id=f"user{u}",
                                conversation_id=f"conv{u}-{i % 5}", turn_index=i, prompt=prompt, answer=answer,
                                created_at=start_ms + i * 1000))
    return turns


@dataclass(frozen=True)
class EmbedUpsertResult:
    turns: int
    batch: int
    repeats: int
    raw_turns_s: float  # median over runs, wall clock
    ours_turns_s: float
    raw_turns_cpu_s: float  # median turns per CPU-second of this process (all threads)
    ours_turns_cpu_s: float
    run_ratios: tuple[float, ...]  # ours / raw within each run (the two sides ran interleaved)

    @property
    def ratio(self) -> float:
        """Median of the per-run ratios: each compares two sides measured side by side."""
        return statistics.median(self.run_ratios)

    def line(self) -> str:
        return f"memory/embed+upsert vs raw encode ratio = {self.ratio:.2f}"


def measure_embed_upsert(turns: int = 512, batch: int = 64, repeats: int = 3) -> EmbedUpsertResult:
    """(a): turns/s of Embedder.encode + ConversationMemory.upsert vs SentenceTransformer.encode."""
    data = synthetic_turns(turns)
    texts = [turn_text(t) for t in data]
    chunks = [(data[i:i + batch], texts[i:i + batch]) for i in range(0, turns, batch)]
    embedder = Embedder(MemorySettings(embedding_batch_size=batch))
    raw_model = embedder.model  # the very same weights: the baseline differs only by our code
    embedder.encode(texts[:batch])  # warm-up: first passes allocate
    raw_rates, our_rates, raw_cpu, our_cpu = [], [], [], []
    upsert_s = 0.0  # wall time inside ConversationMemory.upsert, all runs
    # on disk (the default tmp folder), not /dev/shm: the SQLite commits are part of the cost
    with tempfile.TemporaryDirectory(prefix="chatpipe-bench-mem-") as tmp:
        memory = ConversationMemory(MemorySettings(path=Path(tmp) / "store"), embedder.dim)
        # a store in use: the local partitions these users hash to exist already (creating one costs
        # ~25 ms, once per partition in the life of a store, not per turn)
        memory.upsert([replace(t, turn_id=f"warm-{t.turn_id}") for t in data],
                      np.repeat(embedder.encode(texts[:1]), turns, axis=0))
        for r in range(repeats):
            wall = {"raw": 0.0, "ours": 0.0}
            cpu = {"raw": 0.0, "ours": 0.0}
            for j, (chunk_turns, chunk_texts) in enumerate(chunks):
                # new turn ids each run: every run writes new points, none overwrites
                run_turns = [replace(t, turn_id=f"run{r}-{t.turn_id}") for t in chunk_turns]
                # the sides alternate batch by batch, and which goes first alternates too: load from
                # other processes then falls on both sides alike, and neither inherits warm caches
                for side in (("raw", "ours") if (r + j) % 2 == 0 else ("ours", "raw")):
                    t0, c0 = time.perf_counter(), time.process_time()
                    if side == "raw":
                        raw_model.encode(chunk_texts, batch_size=batch, normalize_embeddings=True,
                                         convert_to_numpy=True, show_progress_bar=False)
                    else:
                        vectors = embedder.encode(chunk_texts)
                        upsert_start = time.perf_counter()
                        memory.upsert(run_turns, vectors)
                        upsert_s += time.perf_counter() - upsert_start
                    wall[side] += time.perf_counter() - t0
                    cpu[side] += time.process_time() - c0
            raw_rates.append(turns / wall["raw"])
            our_rates.append(turns / wall["ours"])
            raw_cpu.append(turns / cpu["raw"])
            our_cpu.append(turns / cpu["ours"])
            assert memory.count() == turns * (r + 2), "the bench lost turns"
            print(f"run {r + 1}: raw encode {raw_rates[-1]:7.1f} turns/s, embed+upsert {our_rates[-1]:7.1f} turns/s "
                  f"(per CPU-s {raw_cpu[-1]:.1f} / {our_cpu[-1]:.1f})")
        memory.close()
    med = statistics.median
    result = EmbedUpsertResult(turns, batch, repeats, med(raw_rates), med(our_rates), med(raw_cpu), med(our_cpu),
                               tuple(o / r for o, r in zip(our_rates, raw_rates)))
    print(f"embed+upsert: {turns} turns in batches of {batch}, median of {repeats}: raw encode "
          f"{result.raw_turns_s:.1f} turns/s, embed+upsert (local mode on disk) {result.ours_turns_s:.1f} turns/s; "
          f"per-run ratios {', '.join(f'{x:.2f}' for x in result.run_ratios)}")
    print(f"per CPU-second of this process: raw encode {result.raw_turns_cpu_s:.1f}, embed+upsert "
          f"{result.ours_turns_cpu_s:.1f} turns (ratio {result.ours_turns_cpu_s / result.raw_turns_cpu_s:.2f}; "
          f"less blurred by other load on the machine)")
    print(f"upsert alone (local mode on disk, WAL): {turns * repeats / upsert_s:,.0f} turns/s")
    return result


@dataclass(frozen=True)
class RecallLatencyResult:
    points: int
    queries: int
    partitions: int
    p50_ms: float
    p99_ms: float
    baseline_p50_ms: float | None  # one unpartitioned collection, if measured
    p99_cpu_ms: float  # p99 of the CPU time each recall used (no waiting for a core)

    def line(self) -> str:
        return (f"memory/recall p99 at {self.points:,} turns (local mode, {self.partitions} partitions) = "
                f"{self.p99_ms:.1f} ms (goal <= 20 ms)")


def _fill(memory: ConversationMemory, turns: list[StoredTurn], dim: int, rng: np.random.Generator) -> None:
    for i in range(0, len(turns), 2000):
        chunk = turns[i:i + 2000]
        vectors = rng.standard_normal((len(chunk), dim)).astype(np.float32)
        memory.upsert(chunk, vectors / np.linalg.norm(vectors, axis=1, keepdims=True))


def _time_recalls(memory: ConversationMemory, turns: list[StoredTurn], queries: int, dim: int,
                  rng: np.random.Generator) -> tuple[list[float], list[float]]:
    """(wall ms, CPU ms) per recall. CPU time is this process's own work; wall time also holds the
    waits for a core, which on a shared VM make up most of a p99."""
    picks = rng.integers(len(turns), size=queries)  # traffic follows who stores turns: heavy users ask more
    wall, cpu = [], []
    for k in picks:
        t = turns[int(k)]
        vector = rng.standard_normal(dim).astype(np.float32)
        query = RecallQuery(t.tenant, t.user_id, vector / np.linalg.norm(vector), exclude_turn_ids=(t.turn_id,))
        start, cpu0 = time.perf_counter(), time.process_time()
        memory.recall_many([query])
        wall.append((time.perf_counter() - start) * 1000)
        cpu.append((time.process_time() - cpu0) * 1000)
    return wall, cpu


def measure_recall_latency(points: int = 100_000, queries: int = 1000, baseline_queries: int = 0,
                           dim: int = 384) -> RecallLatencyResult:
    """(b): p50/p99 of one tenant+user recall with ``points`` turns stored in local mode."""
    rng = np.random.default_rng(1)
    turns = synthetic_turns(points, seed=1)
    per_user = Counter((t.tenant, t.user_id) for t in turns)
    pairs, heaviest = len(per_user), max(per_user.values())
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="chatpipe-bench-recall-", dir=root) as tmp:
        settings = MemorySettings(path=Path(tmp) / "partitioned", recall_limit=4)
        memory = ConversationMemory(settings, dim)
        start = time.perf_counter()
        _fill(memory, turns, dim, rng)
        print(f"recall: stored {points:,} turns (random unit vectors, {dim} dims) of {pairs:,} tenant/user pairs "
              f"(the heaviest user has {heaviest:,}) in {time.perf_counter() - start:.0f} s, "
              f"folder under {root or tempfile.gettempdir()}")
        _time_recalls(memory, turns, 20, dim, rng)  # warm-up
        lat, cpu = _time_recalls(memory, turns, queries, dim, rng)
        memory.close()
        baseline = None
        if baseline_queries:
            one = ConversationMemory(MemorySettings(path=Path(tmp) / "single", local_partitions=1), dim)
            _fill(one, turns, dim, rng)
            baseline = statistics.median(_time_recalls(one, turns, baseline_queries, dim, rng)[0])
            one.close()
    result = RecallLatencyResult(points, queries, settings.local_partitions, float(np.percentile(lat, 50)),
                                 float(np.percentile(lat, 99)), baseline, float(np.percentile(cpu, 99)))
    print(f"recall over {queries} tenant+user queries: p50 {result.p50_ms:.1f} ms, p99 {result.p99_ms:.1f} ms "
          f"wall clock; p99 of CPU time {result.p99_cpu_ms:.1f} ms")
    if baseline is not None:
        print(f"baseline, one unpartitioned local collection: p50 {baseline:.0f} ms "
              f"({baseline_queries} queries; local mode filters point by point in Python)")
    print(result.line())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="about a minute on 2 cores")
    parser.add_argument("--turns", type=int, default=None, help="turns embedded per run (default 1024, quick 256)")
    parser.add_argument("--batch", type=int, default=64, help="turns per batch (the record agent's batch)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per side (default 5, quick 3)")
    parser.add_argument("--points", type=int, default=None, help="stored turns for recall (default 100k, quick 20k)")
    parser.add_argument("--queries", type=int, default=None, help="recalls timed (default 2000, quick 300)")
    parser.add_argument("--baseline-queries", type=int, default=None,
                        help="recalls timed on one unpartitioned collection (default 10, quick 0)")
    args = parser.parse_args()
    quick = args.quick
    print(f"load average before the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
          f"(other work on the machine shows up in wall-clock figures, much less in CPU-time ones)")
    measure_recall_latency(points=args.points or (20_000 if quick else 100_000),
                           queries=args.queries or (300 if quick else 2000),
                           baseline_queries=args.baseline_queries if args.baseline_queries is not None
                           else (0 if quick else 10))
    print(f"load average after recall: {os.getloadavg()[0]:.1f}")
    result = measure_embed_upsert(turns=args.turns or (256 if quick else 1024), batch=args.batch,
                                  repeats=args.repeats or (3 if quick else 5))
    print(result.line())


if __name__ == "__main__":
    main()
