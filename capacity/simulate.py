"""Inference workers under a stream of requests, with or without KEDA scaling them: an event simulation.

The worker model (what ``inference/worker`` + ``inference/engine`` do, at the level that sets queue
wait and throughput):

- **continuous batching**: a worker runs at most ``max_batch`` requests at once; with k running it
  produces ``curve.rate(k)`` output tokens/s in all (the per-worker curve measured by ``bench/``), each
  running request ``rate(k) / k``. A slot that frees is refilled at once from the worker's queue (the
  engine admits every step). A request's work is its output tokens; the curve was measured with
  requests of the same shape, so prefill and the worker's own overhead are inside it.
- **partition intake**: a request sits on its conversation's partition; each partition belongs to one
  serving worker (cooperative-sticky: balanced counts, as few moves as possible); a worker takes the
  oldest waiting request of its partitions. A moved partition pauses ``join_s`` (the rebalance); the old
  owner's running requests of it are cancelled (the revoke hook: nothing answered, nothing
  committed) and the new owner reads from the committed offset, the lowest unfinished one: finished
  requests above it are served again (duplicates readers drop). More workers than partitions sit idle.
- **share intake**: one queue; any serving worker takes the oldest request; no rebalance cost.
- **lag** (KEDA's metric): per partition, end offset - committed offset (committed = lowest unfinished).
- **pods**: a new pod consumes after ``pod_start_s`` (model load), then joins the group; a pod scaled
  down stops taking work, finishes its running requests within ``grace_s`` (the rest are handed back
  uncommitted) and leaves. Not-ready pods are removed first, then the newest (a ReplicaSet's order).
  GPU-hours count every pod from creation until it is gone.

Scaling: ``capacity.keda.ScaledObject`` (the HPA's sync every ``hpa_sync_period_s``, KEDA's activation
check every ``polling_interval_s``), or a fixed number of workers ready at t = 0.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from capacity.keda import ScaledObject, default_lag_threshold
from capacity.settings import ScalingSettings
from capacity.traffic import Request

EPS = 1e-9


@dataclass(frozen=True)
class Curve:
    """Output tokens/s of one worker with k requests running, through measured points (k, tokens/s).

    Linear between points (and from (0, 0) to the first), flat past the last: the engine runs no more
    than its batch, the rest wait.
    """

    points: tuple[tuple[int, float], ...]
    label: str = ""

    def __post_init__(self) -> None:
        if not self.points or any(k < 1 or r <= 0 for k, r in self.points):
            raise ValueError(f"a curve needs points (k >= 1, tokens/s > 0), got {self.points}")
        object.__setattr__(self, "points", tuple(sorted(self.points)))

    @property
    def max_batch(self) -> int:
        return self.points[-1][0]

    def rate(self, k: int) -> float:
        if k <= 0:
            return 0.0
        prev_k, prev_r = 0, 0.0
        for pk, pr in self.points:
            if k <= pk:
                return prev_r + (pr - prev_r) * (k - prev_k) / (pk - prev_k)
            prev_k, prev_r = pk, pr
        return self.points[-1][1]

    def scaled(self, factor: float, label: str | None = None) -> "Curve":
        """The same curve on a machine ``factor`` times as fast (e.g. the share of a core a worker gets)."""
        return Curve(tuple((k, r * factor) for k, r in self.points), label=label or self.label)



@dataclass(frozen=True)
class WorkerParams:
    curve: Curve
    max_batch: int = 0  # 0: the curve's largest point
    pod_start_s: float = 0.0
    join_s: float = 0.0
    intake: str = "partition"  # "partition" | "share"
    grace_s: float = 20.0

    @property
    def batch(self) -> int:
        return self.max_batch or self.curve.max_batch


@dataclass
class _Worker:
    id: int
    created: float
    ready_at: float
    state: str = "starting"  # starting | serving | draining | gone
    partitions: set[int] = field(default_factory=set)
    running: dict[int, float] = field(default_factory=dict)  # request -> virtual finish
    heap: list[tuple[float, int]] = field(default_factory=list)
    v: float = 0.0  # tokens each running request has received (the batch shares the rate equally)
    t: float = 0.0
    version: int = 0


@dataclass
class Sample:
    t: float
    pods: int  # existing pods (starting + serving; draining ones are terminating)
    lag: float  # KEDA's metric as the HPA saw it


@dataclass
class SimulationResult:
    requests: Sequence[Request]
    start: list[float]  # admission of the attempt that answered (queue wait = start - arrival)
    done: list[float]  # first answer
    samples: list[Sample]
    pod_seconds: float
    end_s: float
    duplicates: int  # requests served again after a rebalance (answered twice)
    restarts: int  # running requests cancelled by a revoke or a drain and started again
    max_pods: int
    min_pods: int

    def queue_waits(self) -> list[float]:
        return [s - r.arrival_s for r, s in zip(self.requests, self.start)]

    def latencies(self) -> list[float]:
        return [d - r.arrival_s for r, d in zip(self.requests, self.done)]

    def drain_s(self) -> float:
        """First arrival to the last answer."""
        return max(self.done) - min(r.arrival_s for r in self.requests)

    def gpu_hours(self, gpus_per_worker: int = 1) -> float:
        return self.pod_seconds * gpus_per_worker / 3600.0


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank on the sorted values (q in [0, 1])."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def sticky_assignment(partitions: int, members: Sequence[int], current: dict[int, int | None]) -> dict[int, int | None]:
    """Partition -> member, balanced (counts differ by at most one), keeping current owners where it can."""
    if not members:
        return {p: None for p in range(partitions)}
    members = sorted(members)
    n = len(members)
    base, extra = divmod(partitions, n)
    # Members that already own the most partitions keep the +1 quotas (fewest moves).
    owned = {m: [p for p in range(partitions) if current.get(p) == m] for m in members}
    order = sorted(members, key=lambda m: (-len(owned[m]), m))
    quota = {m: base + (1 if i < extra else 0) for i, m in enumerate(order)}
    result: dict[int, int | None] = {}
    free: list[int] = []
    for m in members:
        result.update(dict.fromkeys(owned[m][: quota[m]], m))  # the partitions it keeps
        free += owned[m][quota[m]:]
    free += [p for p in range(partitions) if current.get(p) not in quota]
    free.sort()
    for m in members:
        while sum(1 for o in result.values() if o == m) < quota[m] and free:
            result[free.pop(0)] = m
    return result


def with_lag_threshold(scaling: ScalingSettings, max_batch: int) -> ScalingSettings:
    """``scaling`` with its lag threshold set: 0 means ``default_lag_threshold`` of the worker's max
    batch, the rule ``chatpipe k8s render`` applies."""
    if scaling.lag_threshold > 0:
        return scaling
    return scaling.model_copy(update={"lag_threshold": float(default_lag_threshold(max_batch))})


class Simulation:
    def __init__(self, requests: Sequence[Request], worker: WorkerParams, *, partitions: int = 6,
                 scaling: ScalingSettings | None = None, replicas: int | None = None, sample_s: float = 15.0) -> None:
        if (scaling is None) == (replicas is None):
            raise ValueError("give either scaling (KEDA) or a fixed number of replicas")
        self.requests = sorted(requests, key=lambda r: r.arrival_s)  # stable: ties keep their order
        self.wp = worker
        self.partitions = partitions if worker.intake == "partition" else 1
        self.scaling = with_lag_threshold(scaling, worker.batch) if scaling is not None else None
        self.fixed = replicas
        self.sample_s = sample_s
        n = len(self.requests)
        self.start = [math.nan] * n
        self.done = [math.nan] * n
        self.pending = [False] * n  # unfinished in its partition's view (counts in the lag)
        self.state = ["future"] * n  # future | waiting | running | done
        self.offset = [0] * n
        self.by_partition: list[list[int]] = [[] for _ in range(self.partitions)]
        self.queue: list[list[tuple[int, int]]] = [[] for _ in range(self.partitions)]  # (offset, request)
        self.unfinished: list[list[int]] = [[] for _ in range(self.partitions)]  # offsets, lazily cleaned
        self.paused_until = [0.0] * self.partitions
        self.owner: dict[int, int | None] = {p: None for p in range(self.partitions)}
        self.workers: list[_Worker] = []
        self.events: list[tuple[float, int, str, int, int]] = []
        self.seq = 0
        self.duplicates = 0
        self.restarts = 0
        self.pod_seconds = 0.0
        self.last_t = 0.0
        self.samples: list[Sample] = []
        self.answered = 0
        self.unacked = 0  # requests not finished (share groups' lag)
        self.alive = 0
        self.batch = worker.batch
        self.per_request = [0.0] + [worker.curve.rate(k) / k for k in range(1, worker.batch + 1)]
        self.keda: ScaledObject | None = None

    # -- events ------------------------------------------------------------------------------------
    def _push(self, t: float, kind: str, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def _partition(self, r: Request) -> int:
        return r.partition % self.partitions if self.wp.intake == "partition" else 0

    # -- workers -----------------------------------------------------------------------------------
    def _advance(self, w: _Worker, now: float) -> None:
        if w.running:
            w.v += (now - w.t) * self.per_request[len(w.running)]
        w.t = now

    def _reschedule(self, w: _Worker) -> None:
        w.version += 1
        while w.heap and w.heap[0][1] not in w.running:
            heapq.heappop(w.heap)
        if w.heap:
            finish_v = w.heap[0][0]
            rate = self.per_request[len(w.running)]  # each running request's share of the worker's rate
            self._push(w.t + max(0.0, finish_v - w.v) / rate, "complete", w.id, w.version)
        elif w.state == "draining":
            self._push(w.t, "leave", w.id, 0)

    def _next_for(self, w: _Worker, now: float) -> int | None:
        best, best_p = None, None
        for p in w.partitions:
            if self.paused_until[p] > now + EPS:
                continue
            q = self.queue[p]
            while q and self.state[q[0][1]] != "waiting":
                heapq.heappop(q)
            if q:
                rid = q[0][1]
                if best is None or (self.requests[rid].arrival_s, rid) < (self.requests[best].arrival_s, best):
                    best, best_p = rid, p
        if best is not None:
            heapq.heappop(self.queue[best_p])
        return best

    def _fill(self, w: _Worker, now: float) -> None:
        if w.state != "serving":
            return
        changed = False
        while len(w.running) < self.batch:
            rid = self._next_for(w, now)
            if rid is None:
                break
            if not changed:
                self._advance(w, now)
                changed = True
            self.state[rid] = "running"
            if math.isnan(self.done[rid]):
                self.start[rid] = now
            finish = w.v + self.requests[rid].output_tokens
            w.running[rid] = finish
            heapq.heappush(w.heap, (finish, rid))
        if changed:
            self._reschedule(w)

    def _complete(self, w: _Worker, now: float) -> None:
        self._advance(w, now)
        finished = [rid for rid, fv in w.running.items() if fv <= w.v + 1e-6]
        for rid in finished:
            del w.running[rid]
            if self.pending[rid]:
                self.unacked -= 1
            self.state[rid] = "done"
            self.pending[rid] = False
            if math.isnan(self.done[rid]):
                self.done[rid] = now
                self.answered += 1
        self._reschedule(w)
        self._fill(w, now)

    def _cancel_running(self, w: _Worker, now: float, only: set[int] | None = None) -> None:
        """Revoke (``only`` = the moved partitions) or drain end: running work goes back, progress lost."""
        self._advance(w, now)
        for rid in list(w.running):
            p = self._partition(self.requests[rid])
            if only is not None and p not in only:
                continue
            del w.running[rid]
            self.state[rid] = "waiting"
            heapq.heappush(self.queue[p], (self.offset[rid], rid))
            self.restarts += 1
        self._reschedule(w)

    def _committed(self, p: int) -> int:
        u = self.unfinished[p]
        while u and not self.pending[self.by_partition[p][u[0]]]:
            heapq.heappop(u)
        return u[0] if u else len(self.by_partition[p])

    def lags(self) -> list[int]:
        """Per partition: a consumer group's end - committed (the lowest unfinished offset, so one long
        generation holds back every later record's commit); a share group's broker count of records not
        yet acknowledged (KIP-1226; acknowledged out of order: nothing is held back)."""
        if self.wp.intake == "share":
            return [self.unacked]
        return [len(self.by_partition[p]) - self._committed(p) for p in range(self.partitions)]

    def _reread_from_committed(self, p: int) -> None:
        """The new owner of ``p`` reads from its committed offset: finished records above it come again."""
        committed = self._committed(p)
        for off in range(committed, len(self.by_partition[p])):
            rid = self.by_partition[p][off]
            if self.state[rid] == "done":
                self.state[rid] = "waiting"
                self.pending[rid] = True
                self.unacked += 1
                heapq.heappush(self.unfinished[p], off)
                heapq.heappush(self.queue[p], (off, rid))
                self.duplicates += 1

    def _rebalance(self, now: float) -> None:
        if self.wp.intake == "share":
            for w in self.workers:
                w.partitions = {0} if w.state == "serving" else set()
        else:
            members = [w.id for w in self.workers if w.state in ("serving", "draining")]
            new = sticky_assignment(self.partitions, members, self.owner)
            moved = {p for p in range(self.partitions) if new[p] != self.owner[p]}
            by_worker: dict[int, set[int]] = {}
            for p in moved:
                old = self.owner[p]
                if old is not None:
                    by_worker.setdefault(old, set()).add(p)
            for wid, ps in by_worker.items():
                self._cancel_running(self.workers[wid], now, only=ps)
            for p in moved:
                if self.owner[p] is not None:
                    self._reread_from_committed(p)
                self.paused_until[p] = now + self.wp.join_s
                if self.wp.join_s > 0:
                    self._push(now + self.wp.join_s, "unpause", p, 0)
            self.owner = new
            for w in self.workers:
                w.partitions = {p for p, o in new.items() if o == w.id}
        for w in self.workers:
            self._fill(w, now)

    def _add_pod(self, now: float, ready_now: bool = False) -> None:
        w = _Worker(id=len(self.workers), created=now, ready_at=now if ready_now else now + self.wp.pod_start_s, t=now,
                    state="serving" if ready_now else "starting")
        self.workers.append(w)
        self._account(now)
        self.alive += 1
        if not ready_now:
            self._push(w.ready_at, "ready", w.id, 0)

    def _remove_pods(self, now: float, n: int) -> None:
        starting = sorted((w for w in self.workers if w.state == "starting"), key=lambda w: -w.created)
        serving = sorted((w for w in self.workers if w.state == "serving"), key=lambda w: (-w.ready_at, -w.id))
        for w in (starting + serving)[:n]:
            if w.state == "starting":
                w.state = "gone"
                self._account(now)
                self.alive -= 1
            else:
                w.state = "draining"  # SIGTERM: no new work; partitions kept until it leaves
                self._push(now + self.wp.grace_s, "drain_deadline", w.id, 0)
                if not w.running:
                    self._push(now, "leave", w.id, 0)

    def _leave(self, w: _Worker, now: float) -> None:
        if w.state != "draining":
            return
        if w.running:
            self._cancel_running(w, now)
        w.state = "gone"
        self._account(now)
        self.alive -= 1
        self._rebalance(now)

    def pods(self) -> int:
        return sum(1 for w in self.workers if w.state in ("starting", "serving"))

    def _account(self, now: float) -> None:
        self.pod_seconds += self.alive * (now - self.last_t)  # pods that exist (starting, serving, draining)
        self.last_t = now

    # -- the run -----------------------------------------------------------------------------------
    def run(self) -> SimulationResult:
        if not self.requests:
            raise ValueError("no requests to simulate")
        t0 = min(0.0, self.requests[0].arrival_s)
        self.last_t = t0
        for _ in range(self.fixed if self.fixed is not None else self.scaling.min_replicas):
            self._add_pod(t0, ready_now=True)
        if self.scaling is not None:
            self.keda = ScaledObject(self.scaling)
            self._push(t0 + self.scaling.hpa_sync_period_s, "hpa")
            self._push(t0 + self.scaling.polling_interval_s, "keda")
        self._rebalance(t0)
        self._push(t0, "sample")
        for i, r in enumerate(self.requests):
            self._push(r.arrival_s, "arrival", i, 0)
        now = t0
        while self.events:
            now, _, kind, a, b = heapq.heappop(self.events)
            self._account(now)
            if kind == "arrival":
                self._arrive(a, now)
            elif kind == "complete":
                w = self.workers[a]
                if b == w.version:
                    self._complete(w, now)
            elif kind == "ready":
                w = self.workers[a]
                if w.state == "starting":
                    w.state = "serving"
                    self._rebalance(now)
            elif kind == "unpause":
                owner = self.owner.get(a)
                if owner is not None:
                    self._fill(self.workers[owner], now)
            elif kind == "drain_deadline":
                self._leave(self.workers[a], now)
            elif kind == "leave":
                w = self.workers[a]
                if w.state == "draining" and not w.running:
                    self._leave(w, now)
            elif kind == "hpa":
                current = self.pods()
                self._scale(now, current, self.keda.hpa.reconcile(now, current, self.metric(self.lags())))
                self._push(now + self.scaling.hpa_sync_period_s, "hpa")
            elif kind == "keda":
                current = self.pods()
                self._scale(now, current, self.keda.poll(now, current, self.lags()))
                self._push(now + self.scaling.polling_interval_s, "keda")
            elif kind == "sample":
                self.samples.append(Sample(now, self.pods(), self.metric(self.lags())))
                if self.answered == len(self.requests):
                    break
                self._push(now + self.sample_s, "sample")
        if self.answered < len(self.requests):
            raise RuntimeError(f"simulation ended with {len(self.requests) - self.answered} request(s) unanswered "
                               "(no worker could take them)")
        pods = [sample.pods for sample in self.samples]  # a sample is taken at t0 and every sample_s
        return SimulationResult(self.requests, self.start, self.done, self.samples, self.pod_seconds, max(self.done),
                                self.duplicates, self.restarts, max(pods), min(pods))

    def metric(self, lags: Sequence[int]) -> float:
        """What the HPA scales on: KEDA's Kafka lag metric (partition intake, capped at the partitions), or the
        plain backlog for share intake (a share group has no consumer-group offsets: a Prometheus trigger
        on ``chatpipe_consumer_lag_records``, which no partition count caps)."""
        if self.wp.intake == "share" or self.scaling is None:
            return float(sum(lags))
        return self.keda.metric(lags)

    def _arrive(self, a: int, now: float) -> None:
        r = self.requests[a]
        p = self._partition(r)
        self.offset[a] = len(self.by_partition[p])
        self.by_partition[p].append(a)
        heapq.heappush(self.unfinished[p], self.offset[a])
        self.pending[a] = True
        self.unacked += 1
        self.state[a] = "waiting"
        heapq.heappush(self.queue[p], (self.offset[a], a))
        if self.wp.intake == "share":  # the least-loaded worker with a free slot pulls it
            free = [w for w in self.workers if w.state == "serving" and len(w.running) < self.batch]
            if free:
                self._fill(min(free, key=lambda w: (len(w.running), w.id)), now)
        elif (owner := self.owner.get(p)) is not None:
            self._fill(self.workers[owner], now)

    def _scale(self, now: float, current: int, target: int) -> None:
        for _ in range(target - current):  # none when scaling down
            self._add_pod(now)
        if target < current:
            self._remove_pods(now, current - target)


def simulate(requests: Sequence[Request], worker: WorkerParams, *, partitions: int = 6,
             scaling: ScalingSettings | None = None, replicas: int | None = None,
             sample_s: float = 15.0) -> SimulationResult:
    return Simulation(requests, worker, partitions=partitions, scaling=scaling, replicas=replicas,
                      sample_s=sample_s).run()
