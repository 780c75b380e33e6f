"""The inference workers' load as they report it, and how long a new request would wait for its first token.

Admission asks one question (the gateway's ``GatewayService.admit``, and streams intake for prompts
produced straight to ``chat.prompts``): can this request get its first token before its deadline? The answer is an estimate from what every worker heartbeats to ``chat.workers.status``
(``inference/worker/heartbeat.py``, every 2 s): its batch (``max_running``), what runs and waits, the
work waiting in tokens (budgets: ``max_tokens`` of each request) and the throughput it measured while it
had more work than its batch (``inference/engine/throughput.py``).

The fleet of one model is taken as one pool (records reach a worker by partition or share group; the
asker cannot pick one):

* a free batch slot: the request starts at once, it waits only for its own prompt (prefill);
* none free: it starts once the work ahead of it, queued and running, is done, at the fleet's measured
  rate: ``(queued output tokens + running requests' output tokens left) / output rate`` (measured over
  decoding steps: ``inference/engine/throughput.py``). The prompts ahead are left out: counted as queued
  prompt tokens over the measured prompt rate they made estimates of 1,300 s for schema-constrained
  requests on a loaded machine (tests/gateway/test_tools.py), whose steps are slow for reasons other
  than their prompts; the output budgets (below) are the larger part of the work and over-count it.
  Exact when the batch runs in step (requests that started together with the same budget all end
  together, and only then is a slot free); requests in a staggered batch free a slot sooner, by up to
  what one batch has left.

Budgets are ``max_tokens``, so a request that stops early at its end of text makes the real wait shorter
than the estimate too: the estimate is an upper bound, and errs towards a 429 that a retry after
``Retry-After`` meets rather than an admission that ends in a 504. Counting one running request's tokens
left instead of the batch's admits a retry that then misses its deadline behind a batch in step
(tests/gateway/test_admission.py makes one).

What the reports cannot show yet is the gateway's own latest work (in Kafka, in streams, taken but not
reported for up to a heartbeat), so the queue ahead is never taken as less than this gateway's own
requests without a first token. Several gateways: each sees the others' work through the reports.
Streams intake asks with no work of its own (``Work()``): what it produced is the gateways' or a direct
producer's, and the reports show it within a heartbeat.

A refusal's ``Retry-After`` is the excess plus ``RETRY_MARGIN`` of the wait: the rate is measured, and
between two heartbeats of a loaded machine it moved enough that a retry at the bare excess met a second
429 ("5 s, longer than this request's 5 s"; tests/gateway/test_admission.py on a 2-core VM with three
other test stacks beside it), and so did a retry with a margin of 0.2 of the wait (the same test, a
fresh-clone run with the engine's tests beside it). A client that waits a little longer gets in at the
first retry.

Unknowns do not refuse: no report yet since the gateway started (``stale_s``: reports arrive every
heartbeat), a worker that reports no batch (a v2 writer) or no throughput measured yet: the request is
admitted, as before any estimate existed. No worker of the model reporting at all, once the first
``stale_s`` have passed: nobody can answer, and ``admit`` says 503 at once.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from schemas.records import WorkerState, WorkerStatus


RETRY_MARGIN = 0.5  # of the estimated wait, added to a refusal's Retry-After (above)


@dataclass(frozen=True, slots=True)
class Work:
    """Requests without a first token yet, in count and tokens (the gateway's own, or the fleet's)."""

    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Estimate:
    first_token_s: float  # wait for a batch slot + the request's own prefill
    wait_s: float  # until a batch slot takes it
    workers: int  # serving workers of the model that reported
    measured: bool  # False: a report lacked what the estimate needs (the request is admitted)


@dataclass(frozen=True, slots=True)
class Shortfall:
    """A deadline the estimate says cannot be met: when a retry would, and the reason to give."""

    retry_s: int
    reason: str


def deadline_shortfall(estimate: Estimate, deadline_at: int | None, now_ms: int) -> Shortfall | None:
    """None when ``estimate``'s first token comes by ``deadline_at`` (epoch ms; None: no deadline), else
    the shortfall: the gateway's 429 ``deadline_unreachable`` and streams intake's refusal say the same."""
    left_s = (deadline_at - now_ms) / 1000 if deadline_at is not None else math.inf
    if estimate.first_token_s <= left_s:
        return None
    retry = max(1, math.ceil(estimate.first_token_s - left_s + RETRY_MARGIN * estimate.wait_s))
    return Shortfall(retry, f"the estimated wait for a first token is {estimate.first_token_s:.0f} s (work queued "
                            f"ahead on {estimate.workers} worker(s) at their measured rate), longer than this "
                            f"request's {max(0.0, left_s):.0f} s to its deadline; retry after {retry} s, when the "
                            "queue ahead will have drained that far")


class Fleet:
    """Latest ``WorkerStatus`` per worker, fed by the gateway's reader (``gateway/replies.py``) on its event
    loop, or by streams' follower thread (``streams/fleet_follower.py``) while intake estimates on its loop
    (the lock: a report may land while an estimate reads)."""

    def __init__(self, stale_s: float, clock=time.monotonic) -> None:
        self.stale_s = stale_s
        self._clock = clock
        self._started = clock()
        self._latest: dict[str, tuple[WorkerStatus, float]] = {}  # worker_id -> (status, received at)
        self._lock = threading.Lock()

    def listening(self) -> None:
        """The reader is positioned: reports can come from now on (the first report period starts)."""
        self._started = self._clock()

    def update(self, status: WorkerStatus) -> None:
        now = self._clock()
        with self._lock:
            self._latest[status.worker_id] = (status, now)
            if len(self._latest) > 64:  # worker ids of restarted processes (host-pid): forget the long silent
                self._latest = {w: (s, at) for w, (s, at) in self._latest.items() if now - at <= 10 * self.stale_s}

    @property
    def warming_up(self) -> bool:
        """True until a full report period has passed since start: no report yet says nothing."""
        return self._clock() - self._started < self.stale_s

    def serving(self, model: str) -> list[WorkerStatus]:
        """Workers of ``model`` whose latest report, fresher than ``stale_s``, says SERVING: its base model,
        or a fine-tuned version (``name@version``) among the ones it holds (WorkerStatus v4)."""
        now = self._clock()
        with self._lock:
            return [s for s, at in self._latest.values()
                    if (s.model == model or model in s.model_versions) and s.state is WorkerState.SERVING
                    and now - at <= self.stale_s]

    def estimate(self, model: str, own: Work, prompt_tokens: int) -> Estimate | None:
        """The first-token time of a request of ``prompt_tokens`` with ``own`` (this gateway's requests of
        the model without a first token) ahead of it; None when no worker of the model serves."""
        workers = self.serving(model)
        if not workers:
            return None
        slots = sum(s.max_running for s in workers)
        running = sum(s.running for s in workers)
        waiting = max(sum(s.waiting for s in workers), own.requests)
        decode = sum(s.decode_tokens_per_s for s in workers)
        prefill = sum(s.prefill_tokens_per_s for s in workers)
        service = prompt_tokens / prefill if prefill > 0 else 0.0
        if any(s.max_running <= 0 for s in workers):  # a v2 report: no batch to compare with
            return Estimate(service, 0.0, len(workers), measured=False)
        if running + waiting < slots:
            return Estimate(service, 0.0, len(workers), measured=True)
        if decode <= 0:  # saturated before a rate was measured
            return Estimate(service, 0.0, len(workers), measured=False)
        queued = max(sum(s.queued_output_tokens for s in workers), own.output_tokens)
        wait = (queued + sum(s.running_output_tokens for s in workers)) / decode
        return Estimate(wait + service, wait, len(workers), measured=True)
