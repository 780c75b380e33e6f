"""Conversation memory on a real 3-peer Qdrant cluster while one peer is SIGKILLed.

The collection has 3 shards with 2 replicas each, spread over the 3 peers. Either a peer the
memory does not talk to, or the very peer it talks to, is killed while a thread recalls without
pause. Every recall must answer, with the right turn, and no stored point may be lost. Qdrant
itself serves a shard from its surviving replica; ``ConversationMemory`` retries transient
failures (connection errors, HTTP 5xx) with backoff, on the next listed peer, and counts them.
Each scenario gets a fresh cluster (a kill leaves it degraded).
Skips, saying why, where ../shared/tools/qdrant is absent.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest

from chatpipe.testing.qdrant import QDRANT_TOOL, SKIP_REASON, QdrantPeer
from streams.memory import ConversationMemory, RecallQuery, StoredTurn
from streams.memory_settings import MemorySettings

DIM = 16
USERS = 10


class QdrantCluster:
    """``size`` peers; the first bootstraps the others. ``wait_formed`` waits until all are voters."""

    def __init__(self, root: Path, size: int = 3) -> None:
        self.peers = [QdrantPeer(root, f"peer{i}", cluster=True) for i in range(size)]

    def start(self, timeout_s: float = 90.0) -> None:
        first, rest = self.peers[0], self.peers[1:]
        first.start()
        first.wait_ready(timeout_s)
        for peer in rest:
            peer.start(bootstrap=first)
        for peer in rest:
            peer.wait_ready(timeout_s)
        self.wait_formed(timeout_s)

    def wait_formed(self, timeout_s: float) -> None:
        deadline, last = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            try:
                last = httpx.get(f"{self.peers[0].url}/cluster", timeout=2.0).json()["result"]
                if len(last.get("peers", {})) == len(self.peers) and last["raft_info"].get("leader") is not None:
                    return
            except (httpx.TransportError, KeyError, ValueError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"cluster not formed after {timeout_s} s: {last}\n{self.peers[-1].log_tail()}")

    def active_replicas(self, collection: str) -> int:
        """Shard replicas in state Active, as the first peer sees them (local + remote)."""
        info = httpx.get(f"{self.peers[0].url}/collections/{collection}/cluster", timeout=2.0).json()["result"]
        shards = info.get("local_shards", []) + info.get("remote_shards", [])
        return sum(1 for s in shards if s.get("state") == "Active")

    def stop(self) -> None:
        for peer in self.peers:
            peer.stop()


@pytest.fixture
def qdrant_cluster(tmp_path_factory):
    """A fresh real 3-peer Qdrant cluster per test (tests kill peers); yields QdrantCluster, consensus
    formed. Skips without the binary."""
    if not QDRANT_TOOL.exists():
        pytest.skip(SKIP_REASON)
    cluster = QdrantCluster(tmp_path_factory.mktemp("qdrant-cluster"), size=3)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()

def unit_vectors(n: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def planted(prefix: str, tenant: str, n: int, now_ms: int) -> list[StoredTurn]:
    return [StoredTurn(f"{prefix}{i}", tenant, f"user{i % USERS}", f"conv{i % 3}", i, f"prompt {prefix}{i}",
                       "answer", now_ms) for i in range(n)]


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.parametrize("victim_is", ["another peer", "the client's peer"])
def test_recall_keeps_answering_and_no_point_is_lost_when_a_peer_is_killed(qdrant_cluster, victim_is):
    """Guards against recall failing (or silently returning less) while a replica's peer dies, and
    against losing acknowledged points: each was upserted with wait=True to replicated shards.

    "another peer": the memory talks to peer 0 and peer 2 dies; Qdrant serves the dead replicas'
    shards from their other copy. "the client's peer": the memory lists peers 0 and 1 in ``url``
    and peer 0 (the one it talks to, also the first Raft leader) dies; calls fail over to peer 1.
    """
    cluster = qdrant_cluster
    client_peer = cluster.peers[0]
    if victim_is == "another peer":
        url, victim = client_peer.url, cluster.peers[2]
    else:
        url, victim = f"{client_peer.url},{cluster.peers[1].url}", client_peer
    name = f"turns_{uuid.uuid4().hex[:8]}"
    mem = ConversationMemory(MemorySettings(url=url, collection=name, shards=3, replication_factor=2,
                                            retries=10, retry_backoff_s=0.1, timeout_s=5), DIM)
    try:
        wait_until(lambda: cluster.active_replicas(name) == 6, 60, "6 active shard replicas")
        params = httpx.get(f"{client_peer.url}/collections/{name}").json()["result"]["config"]["params"]
        assert (params["shard_number"], params["replication_factor"]) == (3, 2)
        on_victim = httpx.get(f"{victim.url}/collections/{name}/cluster").json()["result"]["local_shards"]
        assert on_victim, "the peer to kill holds no replica: killing it would prove nothing"

        now = int(time.time() * 1000)
        vectors = unit_vectors(360, seed=7)
        acme, globex = planted("a", "acme", 300, now), planted("g", "globex", 30, now)
        mem.upsert(acme, vectors[:300])
        mem.upsert(globex, vectors[:30])  # same vectors, same user ids, other tenant: must never show up
        assert mem.count(tenant="acme") == 300 and mem.count() == 330

        outcomes: list[tuple[float, str]] = []  # (time, "ok" or what went wrong)
        stop = threading.Event()

        def recall_forever() -> None:
            k = 0
            while not stop.is_set():
                i = k % 300
                k += 1
                try:
                    got = mem.recall_many([RecallQuery("acme", f"user{i % USERS}", vectors[i], limit=1)])[0]
                    ok = len(got) == 1 and got[0].turn == acme[i]
                    outcomes.append((time.monotonic(), "ok" if ok else f"wrong answer for a{i}: {got}"))
                except Exception as exc:  # noqa: BLE001 - recorded, not raised: the assertion below reports them all
                    outcomes.append((time.monotonic(), f"{type(exc).__name__}: {exc}"))

        reader = threading.Thread(target=recall_forever, daemon=True)
        reader.start()
        time.sleep(1.5)
        killed_at = time.monotonic()
        victim.kill()
        time.sleep(6.0)
        stop.set()
        reader.join(60)
        assert not reader.is_alive(), "a recall hung after the peer was killed"

        after = [o for t, o in outcomes if t > killed_at]
        failures = [o for _, o in outcomes if o != "ok"]
        assert victim.proc.poll() is not None, "the victim peer is still running"
        assert len(after) >= 20, f"only {len(after)} recalls ran after the kill"
        assert not failures, f"{len(failures)} of {len(outcomes)} recalls failed, first: {failures[:3]}"

        if victim_is == "the client's peer":
            assert mem.retrier.retries >= 1, "no call failed over: the kill did not reach the client's peer"
        # writes still land (the dead replica is taken out of the shard by consensus)
        late = planted("late", "acme", 30, now)
        mem.upsert(late, vectors[300:330])
        assert mem.count(tenant="acme") == 330 and mem.count(tenant="globex") == 30
        # every acknowledged point is still there and recallable, none from the other tenant
        queries = [RecallQuery("acme", t.user_id, v, limit=1) for t, v in zip(acme + late, vectors[:330])]
        answers = mem.recall_many(queries)
        lost = [t.turn_id for t, got in zip(acme + late, answers) if not got or got[0].turn != t]
        assert not lost, f"{len(lost)} planted points not recalled after the kill: {lost[:5]}"
        print(f"\n{len(outcomes)} recalls ({len(after)} after the kill), retries made: {mem.retrier.retries}")
    finally:
        mem.close()
