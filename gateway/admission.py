"""Whether the gateway takes a request: by its estimated wait against its deadline, not by counting.

In order, for each prompt (``GatewayService._produce``):

1. **Memory guard** (``max_pending``, ``tenant_share`` of it): the gateway holds every request in flight in
   memory (its reply queue, its choices, a span: ``MEMORY_PER_PENDING`` below), so it takes no more than
   ``max_pending`` at once, a tenant no more than its share. The defaults are high enough that the estimate
   decides; they bound memory, not the queue. 429 ``backlog_full`` / ``tenant_backlog_full``.
2. **A worker must serve the model** (``fleet.Fleet``: a fresh SERVING report of that model): none, and
   nobody can answer; 503 ``no_worker`` at once instead of a 504 at the deadline.
3. **The first token must fit the deadline**: the fleet's estimate (``fleet.py``) of the request's time
   to first token, with this gateway's own requests that have no first token yet ahead of it, against
   the time left to its deadline (``first_chunk_timeout_s``, or the client's ``X-Chatpipe-Timeout-S``).
   Longer: 429 ``deadline_unreachable`` with ``Retry-After`` = the excess plus a margin (``fleet.py``): the
   queue ahead drains at the measured rate, so a retry then fits unless more work arrived meanwhile. The
   estimate uses each request's ``max_tokens``, an upper bound: requests that stop early make the real
   wait shorter.
4. **Flex needs room soon**: ``service_tier: flex`` is the batch class, which runs only where no
   interactive request waits; when the estimated wait for a batch slot is over ``flex_max_wait_s`` it
   gets 429 ``flex_capacity_unavailable`` (OpenAI's flex answers 429 when it has no capacity), with
   ``Retry-After`` = the excess.

A refusal is decided from memory (no I/O): it comes back within milliseconds.
"""

from __future__ import annotations

import math
from typing import Iterable

from transport.fleet import Fleet, Work, deadline_shortfall
from gateway.metrics import GatewayMetrics
from gateway.openai_api import OpenAIError
from gateway.settings import GatewaySettings
from schemas.records import Priority, PromptRequest, now_ms

# Measured: bench/load.py, the gateway's RSS with its requests in flight less idle, per request
# (77 -> 89 MiB at 256 streams, 48 KiB each; 62 KiB at 64; docs/benchmarks.md). 4096 of them: ~200 MiB.
MEMORY_PER_PENDING = "about 50 KiB"
CHARS_PER_TOKEN = 4  # the gateway has no tokenizer: a prompt's tokens are estimated from its characters


def work_of(prompt: PromptRequest) -> Work:
    """The work a prompt asks of a worker, in tokens: its text (estimated) and ``n`` × ``max_tokens``."""
    chars = len(prompt.raw_prompt or "") + sum(len(m.content or "") for m in prompt.messages)
    return Work(1, math.ceil(chars / CHARS_PER_TOKEN), prompt.sampling.n * prompt.sampling.max_tokens)


def total(works: Iterable[Work]) -> Work:
    requests = prompt = output = 0
    for work in works:
        requests, prompt, output = requests + work.requests, prompt + work.prompt_tokens, output + work.output_tokens
    return Work(requests, prompt, output)


class Admission:
    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics, fleet: Fleet) -> None:
        self.settings = settings
        self.metrics = metrics
        self.fleet = fleet

    def check(self, prompt: PromptRequest, in_flight: int, tenant_held: int, not_started: Work,
              guard_retry_s: int = 1, work: Work | None = None, fleet_model: str | None = None) -> None:
        """Raises OpenAIError (429 / 503) when ``prompt`` is not taken. ``in_flight``: the gateway's
        requests; ``tenant_held``: those of the prompt's tenant; ``not_started``: the gateway's requests
        of the prompt's model without a first token; ``guard_retry_s``: Retry-After of a memory-guard 429;
        ``work``: ``work_of(prompt)`` when the caller has it already; ``fleet_model``: the model whose workers
        answer it (the base model of an alias, the version itself; default: the prompt's model)."""
        self._memory_guard(prompt.tenant, in_flight, tenant_held, guard_retry_s)
        work = work or work_of(prompt)
        fleet_model = fleet_model or prompt.model
        estimate = self.fleet.estimate(fleet_model, not_started, work.prompt_tokens)
        if estimate is None:
            if self.fleet.warming_up:
                return  # no report has had the time to come yet: nothing is known, nothing refused
            self.metrics.requests.labels("rejected_no_worker").inc()
            raise OpenAIError(503, f"no inference worker serving {fleet_model!r} has reported in the last "
                                   f"{self.fleet.stale_s:g} s (chat.workers.status); nothing could answer this "
                                   "request. Retry once a worker is up", type="server_error", code="no_worker",
                              headers={"Retry-After": str(max(1, math.ceil(self.fleet.stale_s)))})
        shortfall = deadline_shortfall(estimate, prompt.deadline_at, now_ms())
        if shortfall is None:
            self._flex_room(prompt, estimate.wait_s)
            return
        raise self._too_many("rejected_wait", "deadline_unreachable", shortfall.retry_s, shortfall.reason)

    def _flex_room(self, prompt: PromptRequest, wait_s: float) -> None:
        limit = self.settings.flex_max_wait_s
        if prompt.priority is not Priority.BATCH or wait_s <= limit:
            return
        retry = max(1, math.ceil(wait_s - limit))
        raise self._too_many("rejected_flex", "flex_capacity_unavailable", retry,
                             f"service_tier flex: the estimated wait for a batch slot is {wait_s:.0f} s, over flex's "
                             f"{limit:g} s (CHATPIPE_GATEWAY_FLEX_MAX_WAIT_S); retry after {retry} s, or send it "
                             "with service_tier default")

    def _memory_guard(self, tenant: str, in_flight: int, tenant_held: int, retry: int) -> None:
        limit = max(1, int(self.settings.max_pending * self.settings.tenant_share))  # at least 1 request
        if in_flight >= self.settings.max_pending:
            raise self._too_many("rejected_busy", "backlog_full", retry,
                                 f"the gateway has {in_flight} requests in flight (limit {self.settings.max_pending}, "
                                 f"CHATPIPE_GATEWAY_MAX_PENDING); retry after {retry} s")
        if tenant_held >= limit:
            raise self._too_many("rejected_tenant_busy", "tenant_backlog_full", retry,
                                 f"tenant {tenant!r} has {tenant_held} requests in flight on this gateway, its limit "
                                 f"({self.settings.tenant_share:g} of max_pending {self.settings.max_pending} = "
                                 f"{limit}; CHATPIPE_GATEWAY_TENANT_SHARE); retry after {retry} s, or send fewer "
                                 "requests at once. Other tenants are not affected")

    def _too_many(self, outcome: str, code: str, retry: int, message: str) -> OpenAIError:
        """A 429 counted under ``outcome`` (the requests metric), with its Retry-After."""
        self.metrics.requests.labels(outcome).inc()
        return OpenAIError(429, message, type="rate_limit_error", code=code, headers={"Retry-After": str(retry)})
