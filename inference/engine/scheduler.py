"""Continuous-batching scheduler: at every step, which requests run and how many tokens each computes.

Pure Python (no torch, no I/O), unit-tested without a model. vLLM-v1 style: there are no prefill
or decode phases, only "tokens computed vs tokens wanted" per request, so new requests' prompt
chunks and running requests' next tokens share one step. One step computes at most
``max_step_tokens`` tokens (this bounds step latency, i.e. what a long prompt costs everyone else).

Policy, in order, each ``schedule()``:
  1. cancellations requested since the last step are applied: their KV blocks are freed;
  2. running requests get their missing tokens (1 when decoding, a prompt chunk when prefilling),
     decodes first so a long prompt never stalls running generations. KV blocks are allocated
     lazily, for the tokens computed this step; when there is no block left, the running request
     with the lowest priority, most recently admitted, is *preempted*: its blocks are freed (full
     ones stay in the prefix cache), it goes back to the head of its priority class in the
     waiting queue, and later recomputes its prompt and the tokens it already produced (greedy
     output is unchanged; a sampled request keeps its own generator);
  3. waiting requests are admitted in queue-policy order (interactive before batch; inside a class
     ``fair``: the tenant served least first, FCFS within a tenant, ``fair_queue.py``; ``priority``:
     FCFS; preempted requests first by admission order) while there is a free batch slot, KV room
     and step budget. With ``fair``, a full batch makes room for a tenant under its share first
     (``fair_queue.fairness_victim``: one request of a tenant over its share is preempted, and the
     step computes only the prompts it made room for), and an interactive request at the head makes
     room the same way by preempting the most recently admitted running *batch* request
     (``priority_victim``: the batch class fills what interactive traffic leaves and yields to it, so
     an interactive first token never waits for a batch generation to end; the victim's full blocks
     stay in the prefix cache, so its recompute is short). A new request reuses the longest cached
     prefix of its tokens and computes only the rest. The head of the queue is never skipped for a
     smaller request behind it, and a new arrival never preempts a running request of its own class to
     run sooner itself, only to give its tenant its fair share against another's (no starvation). An
     n > 1 sibling (``add_group``, ``Request.prompt_leader``) waits at the head until its leader
     has computed the shared prompt, then takes those blocks from the prefix cache.

``kv_allocation="reserve"`` keeps the old worst-case reservation (prompt + max_new_tokens at
admission, never preempted): the baseline of ``bench/engine.py --multi-turn``.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal

from inference.engine.block_allocator import BlockAllocator
from inference.engine.errors import InvalidRequestError
from inference.engine.fair_queue import FairWaitingQueue, TenantCounters, fairness_victim
from inference.engine.request import Admission, FinishReason, Priority, Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 16  # most requests running at once
    max_seq_len: int = 2048  # most tokens (prompt + output) one request may hold
    max_step_tokens: int = 512  # most tokens computed in one step (prompt chunks + decodes)
    max_waiting: int = 256  # waiting-queue bound; beyond it add_group answers OVERLOADED
    queue_policy: Literal["fair", "priority", "fcfs"] = "fair"
    kv_allocation: Literal["lazy", "reserve"] = "lazy"  # allocate as computed, preempt when out; or worst case


class WaitingQueue:
    """The waiting queue: a FIFO per priority class, classes in priority order (interactive before
    batch); ``queue_policy="fcfs"`` keeps one FIFO for all (arrival order, priority ignored)."""

    def __init__(self, policy: Literal["priority", "fcfs"]) -> None:
        self._by_priority = policy == "priority"
        classes = sorted(Priority) if self._by_priority else [Priority.INTERACTIVE]
        self._qs: dict[Priority, collections.deque[Request]] = {p: collections.deque() for p in classes}

    def _queue(self, request: Request) -> collections.deque[Request]:
        return self._qs[request.priority if self._by_priority else Priority.INTERACTIVE]

    def push(self, request: Request) -> None:
        self._queue(request).append(request)

    def push_preempted(self, request: Request) -> None:
        """Back to the head (of its class), behind preempted requests admitted before it."""
        q = self._queue(request)
        i = 0
        while i < len(q) and q[i].admit_seq is not None and q[i].admit_seq < request.admit_seq:
            i += 1
        q.insert(i, request)

    def peek(self) -> Request | None:
        return next((q[0] for q in self._qs.values() if q), None)

    def pop(self) -> Request:
        for q in self._qs.values():
            if q:
                return q.popleft()
        raise IndexError("pop from an empty queue")

    def remove(self, request: Request) -> bool:
        try:
            self._queue(request).remove(request)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return sum(len(q) for q in self._qs.values())

    def __iter__(self) -> Iterator[Request]:
        """In the order they would run."""
        return itertools.chain.from_iterable(self._qs.values())


@dataclass(frozen=True, slots=True)
class QueueLoad:
    queued_prompt_tokens: int  # prompt tokens of the waiting requests not computed yet
    queued_output_tokens: int  # output tokens the waiting requests may still generate (max_new_tokens)
    running_output_tokens: int  # output tokens the running requests may still generate


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # first position computed this step (== request.num_computed_tokens)
    num_new_tokens: int  # positions [start, start + num_new_tokens) are computed this step
    sample: bool  # the chunk reaches the last known token, so its logits give the next token


def priority_victim(head: Request, running: list[Request]) -> Request | None:
    """The running request of a less urgent class than ``head`` admitted last (None: none runs)."""
    return max((r for r in running if r.priority > head.priority), key=lambda r: r.admit_seq or 0, default=None)


@dataclass
class SchedulerOutput:
    # What the model computes this step; decodes (1 token) first, then prompt chunks.
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Requests moved from waiting to running by this call (they now hold KV blocks).
    admitted: list[Request] = field(default_factory=list)
    # Requests retired by this call (cancellations); their KV blocks are already freed.
    finished: list[Request] = field(default_factory=list)
    # Running requests sent back to the waiting queue for lack of KV blocks (recomputed later).
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    """Owns the waiting queue, the running set and their KV blocks. Thread-safe: the engine's
    step thread calls ``schedule``/``update_from_output``, callers may ``add_group``/``abort``
    from elsewhere."""

    def __init__(
        self, config: SchedulerConfig, allocator: BlockAllocator, clock: Callable[[], float] = time.monotonic,
        adapter_ready: Callable[[Any], bool] = lambda adapter: True,
    ) -> None:
        self.config = config
        # Whether a request's LoRA adapter (its registration) is in memory; until it is, the request waits at
        # the queue's head like an n > 1 sibling waiting for its leader (the engine loads it meanwhile).
        self.adapter_ready = adapter_ready
        self.allocator = allocator
        self.clock = clock
        self.counters = TenantCounters()
        self.fair = config.queue_policy == "fair"
        self.waiting: WaitingQueue | FairWaitingQueue = (
            FairWaitingQueue(self.counters) if self.fair else WaitingQueue(config.queue_policy))
        self.running: list[Request] = []  # admission order
        self._by_id: dict[str, Request] = {}
        self._pending_aborts: list[str] = []
        self._admissions = 0
        self.num_preemptions = 0
        self.num_fairness_preemptions = 0  # of num_preemptions: to give a tenant its share, not for KV room
        self.num_priority_preemptions = 0  # of num_preemptions: a batch request making way for an interactive one
        self._lock = threading.RLock()

    # -- callers ---------------------------------------------------------------------------------

    def add_group(self, requests: list[Request]) -> Admission:
        """Queue requests together (n > 1 siblings): all accepted or none."""
        with self._lock:
            ids = [r.request_id for r in requests]
            for rid in ids:
                if rid in self._by_id:
                    raise InvalidRequestError(f"request id {rid!r} is already in the engine")
            if len(set(ids)) != len(ids):
                raise InvalidRequestError(f"request ids {ids} repeat one another")
            for request in requests:
                if not request.prompt_token_ids:
                    raise InvalidRequestError("the prompt is empty (no tokens): give some text to answer or continue")
            for request in requests:
                if request.max_tokens > self.config.max_seq_len or not self.allocator.can_ever_fit(request.max_tokens):
                    return Admission.TOO_LARGE
            if len(self.waiting) + len(requests) > self.config.max_waiting:
                return Admission.OVERLOADED
            for request in requests:
                request.timings.arrival = self.clock()
                request.status = RequestStatus.WAITING
                self.counters.arrived(request)
                self.waiting.push(request)
                self._by_id[request.request_id] = request
            return Admission.ACCEPTED

    def abort(self, request_id: str) -> bool:
        """Cancel; the request's cache is freed at the next ``schedule()``. False if unknown/finished."""
        with self._lock:
            if request_id not in self._by_id:
                return False
            self._pending_aborts.append(request_id)
            return True

    # -- the step loop ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        with self._lock:
            out = SchedulerOutput()
            self._apply_aborts(out)
            made_room_for = self._make_room(out) if self.config.queue_policy != "fcfs" else []
            fairness_step = bool(made_room_for)
            kv_preempted = len(out.preempted)
            budget = self.config.max_step_tokens
            scheduled: dict[str, ScheduledChunk] = {}
            # Most protected first: decodes before prompt chunks, then priority and admission order. A step
            # that made room for a tenant under its share computes that request's prompt alone: its first
            # token does not wait for a full batch of decodes (on a CPU a step's time grows with the batch);
            # the batch waits one short step instead.
            order = [] if fairness_step else sorted(
                self.running, key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, self._rank(r)))
            for req in order:
                if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                    continue
                missing = req.num_tokens - req.num_computed_tokens
                n = min(missing, budget)
                if n <= 0:
                    continue
                while not self.allocator.allocate_slots(req.request_id, req.num_computed_tokens + n):
                    victim = max(self.running, key=self._rank)
                    self._preempt(victim, out)
                    undone = scheduled.pop(victim.request_id, None)
                    if undone is not None:
                        budget += undone.num_new_tokens
                    if victim is req:
                        break
                if req.status is not RequestStatus.RUNNING:
                    continue
                budget -= n
                scheduled[req.request_id] = ScheduledChunk(req, req.num_computed_tokens, n, sample=n == missing)
            # A step that had to preempt admits nobody: the room it made is for the running requests.
            while len(out.preempted) == kv_preempted and budget > 0 and len(self.running) < self.config.max_batch:
                # The requests fairness preemptions made room for, only them: a victim, back at the head of
                # its tenant's queue with an equal counter, would otherwise take its slot back.
                if fairness_step and not made_room_for:
                    break
                req = made_room_for.pop(0) if fairness_step else self.waiting.peek()
                if req is None or not self._prompt_ready(req):
                    break
                chunk = self._admit(req, budget)
                if chunk is None:
                    break
                self.waiting.remove(req)
                out.admitted.append(req)
                budget -= chunk.num_new_tokens
                scheduled[req.request_id] = chunk
            chunks = list(scheduled.values())
            out.chunks = [c for c in chunks if c.num_new_tokens == 1] + [c for c in chunks if c.num_new_tokens > 1]
            return out

    def _make_room(self, out: SchedulerOutput) -> list[Request]:
        """A full batch: while the queue's next request is interactive and a batch request runs, preempt
        the latter (``priority_victim``); while it belongs to a tenant under its share (``fair``), preempt
        one request of a tenant over it (``fair_queue.fairness_victim``). Returns the requests the room is
        for, in order (several: requests that arrived together start in one step)."""
        if len(self.running) < self.config.max_batch:
            return []
        chosen: list[Request] = []
        for head in list(self.waiting):  # the queue's order, before any victim joins it
            if not self._prompt_ready(head):
                break
            victim = priority_victim(head, self.running)
            if victim is not None:
                self.num_priority_preemptions += 1
            elif self.fair and (victim := fairness_victim(head, self.running, self.counters, chosen)) is not None:
                self.num_fairness_preemptions += 1
            else:
                break
            self._preempt(victim, out)
            chosen.append(head)
        return chosen

    def _prompt_ready(self, req: Request) -> bool:
        """False for an n > 1 sibling whose leader has not computed the shared prompt yet: admitted
        now, it would compute the same blocks a second time. The queue waits for it (its head is
        never skipped); the leader is ahead of it, so this lasts until the leader's first token.
        False too while the request's adapter is not in memory (it is loading, or waits for a slot)."""
        if req.adapter is not None and not self.adapter_ready(req.adapter):
            return False
        leader = req.prompt_leader
        if leader is None or not self.allocator.prefix_caching or not leader.register_blocks:
            return True
        return leader.is_finished or bool(leader.output_token_ids) or (
            leader.num_computed_tokens >= len(leader.prompt_token_ids))

    def _rank(self, req: Request) -> tuple[int, int]:
        """Preemption order: the largest is preempted first (lowest priority, most recently admitted)."""
        return (int(req.priority), req.admit_seq or 0)

    def _admit(self, req: Request, budget: int) -> ScheduledChunk | None:
        """Take the request's cached prefix and blocks for its first chunk; None if they do not fit."""
        alloc = self.allocator
        cached: list[int] = []
        if alloc.prefix_caching:
            alloc.hashes_of(req.token_at, req.num_tokens, req.block_hashes, req.tenant, req.adapter_key)
            # At least the last token is computed: its logits give the next token.
            cached = alloc.cached_prefix(req.block_hashes, (req.num_tokens - 1) // alloc.block_size)
        start = len(cached) * alloc.block_size
        n = min(req.num_tokens - start, budget)
        if self.config.kv_allocation == "reserve":
            target, headroom = req.max_tokens, 0
        else:
            # Leave one block per running request so next step's decodes do not preempt at once.
            target, headroom = start + n, len(self.running)
        if not alloc.fits(target, cached, headroom) or not alloc.allocate_slots(req.request_id, target, cached):
            return None
        if alloc.prefix_caching:
            alloc.queried_tokens += req.num_tokens  # of an admission, like the hits allocate_slots counts
        req.num_computed_tokens = start
        req.num_cross_tenant_cached_tokens = alloc.note_reuse(cached, req.owner) * alloc.block_size if cached else 0
        req.status = RequestStatus.RUNNING
        if req.admit_seq is None:  # first admission: what its prompt took from the cache (Request.num_cached_tokens)
            req.num_cached_tokens = start
            req.admit_seq = self._admissions
            self._admissions += 1
            req.timings.admitted = self.clock()
        self.running.append(req)
        return ScheduledChunk(req, start, n, sample=start + n == req.num_tokens)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.allocator.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_preempted(req)
        out.preempted.append(req)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Record a step's result: advance computed tokens, append sampled tokens, retire finished
        requests (freeing their KV blocks). Returns the requests that finished."""
        with self._lock:
            finished: list[Request] = []
            now = self.clock()
            for chunk in out.chunks:
                req = chunk.request
                if req.is_finished:  # aborted while the step ran
                    continue
                req.num_computed_tokens += chunk.num_new_tokens
                self.counters.charge(req, req.num_computed_tokens, chunk.sample)
                if self.allocator.prefix_caching and req.register_blocks:
                    full = req.num_computed_tokens
                    hashes = self.allocator.hashes_of(req.token_at, full, req.block_hashes, req.tenant, req.adapter_key)
                    self.allocator.register(req.request_id, hashes, full // self.allocator.block_size, req.owner)
                if not chunk.sample:
                    continue
                token = sampled[req.request_id]
                req.output_token_ids.append(token)
                if req.timings.first_token is None:
                    req.timings.first_token = now
                if token in req.params.stop_token_ids:
                    self._finish(req, FinishReason.STOP)
                elif len(req.output_token_ids) >= req.params.max_new_tokens or req.num_tokens >= self.config.max_seq_len:
                    self._finish(req, FinishReason.LENGTH)
                else:
                    continue
                finished.append(req)
            return finished

    # -- state -----------------------------------------------------------------------------------

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.running or len(self.waiting) or self._pending_aborts)

    def get(self, request_id: str) -> Request | None:
        return self._by_id.get(request_id)

    def load(self) -> QueueLoad:
        """The work held now, in tokens (budgets: what each request may still compute or generate)."""
        with self._lock:
            waiting = list(self.waiting)
            return QueueLoad(
                queued_prompt_tokens=sum(len(r.prompt_token_ids) - r.num_computed_tokens for r in waiting),
                queued_output_tokens=sum(r.params.max_new_tokens - len(r.output_token_ids) for r in waiting),
                running_output_tokens=sum(r.params.max_new_tokens - len(r.output_token_ids) for r in self.running))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def forget(self, tenant: str, user_id: str) -> int:
        """Drop the user's blocks from the prefix cache (``BlockAllocator.forget``); that user's
        requests still in the engine cache nothing more. Returns the blocks dropped."""
        with self._lock:
            owner = (tenant, user_id)
            for req in self._by_id.values():
                if req.owner == owner:
                    req.register_blocks = False
            return self.allocator.forget(owner)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a request now (the engine's stop-string check): it is not scheduled again."""
        with self._lock:
            if not req.is_finished:
                self._finish(req, reason)

    def adapter_keys(self) -> tuple[set[str], str | None]:
        """The adapter keys of the running requests, and the one the queue's head runs with (None: none)."""
        with self._lock:
            head = self.waiting.peek()
            return ({r.adapter_key for r in self.running if r.adapter is not None},
                    head.adapter_key if head is not None else None)

    def fail_waiting(self, adapter_key: str, reason: str) -> list[Request]:
        """End (ERROR, ``reason``) the waiting requests that run with ``adapter_key``: its load failed."""
        with self._lock:
            failed = [r for r in self.waiting if r.adapter_key == adapter_key]
            for req in failed:
                self.waiting.remove(req)
                req.error = reason
                self._finish(req, FinishReason.ERROR)
            return failed

    def _apply_aborts(self, out: SchedulerOutput) -> None:
        pending, self._pending_aborts = self._pending_aborts, []
        for rid in pending:
            req = self._by_id.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status is RequestStatus.WAITING:
                self.waiting.remove(req)
            self._finish(req, FinishReason.ABORTED)
            out.finished.append(req)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.request_id in self._by_id:
            self.counters.left(req)
        self.allocator.free(req.request_id)
        self._by_id.pop(req.request_id, None)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.timings.finished = self.clock()
