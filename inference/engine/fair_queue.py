"""Fair share among tenants, only when they compete: a virtual token counter (VTC) per tenant.

The engine's waiting queue is where work waits for the scarce thing (a batch slot, KV room) and the
one place that sees every request's tokens, so this is where tenants are ordered (docs/architecture.md
"Under load: fair share"). The mechanism is VTC (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024):

- every tenant has a counter of the service it received, in weighted tokens: a prompt token the
  engine computed counts ``PROMPT_TOKEN_COST``, an output token ``OUTPUT_TOKEN_COST`` (the paper's
  1 and 2: a decode step costs a request more than one prefill token), divided by the tenant's share
  weight (the keys file's ``weight``, carried on the request). Tokens from the prefix cache cost
  nothing; a preempted request's recomputed prompt is not charged twice (``Request.num_charged``);
- within a priority class the queue admits the head (FCFS) of the tenant with the lowest counter,
  so a tenant that sends long generations does not starve one that sends short ones: tokens served
  are what is shared, not requests counted;
- a tenant that comes back after it had nothing in the engine starts at the lowest counter of those
  still there (the "lift"): idle time is not banked into a burst that would starve the others, and
  past service is not held against it;
- work-conserving: a tenant alone is always first, however much it was served;
- a full batch is no wall: when every slot is taken, the waiting head's tenant holds fewer slots than
  its weighted share and another tenant of the same class more (and was served as much or more), that tenant's
  most recently admitted request is preempted (``fairness_victim``): it keeps its output and its full
  KV blocks stay in the prefix cache, so it recomputes little when it is admitted again. After the
  swap the victim's tenant still holds at least the waiting tenant's share, so it cannot swap back.

Priority classes stay as they are (interactive before batch); fairness orders tenants inside one.
Pure Python, no torch, unit-tested without a model (tests/engine/test_fair_queue.py).
"""

from __future__ import annotations

import collections
from typing import Iterator

from inference.engine.request import Priority, Request

PROMPT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0


class TenantCounters:
    """Each tenant's service received (weighted tokens) and how many of its requests are in the engine."""

    def __init__(self) -> None:
        self.served: dict[str, float] = {}
        self.weight: dict[str, float] = {}
        self.in_engine: collections.Counter[str] = collections.Counter()

    def arrived(self, request: Request) -> None:
        tenant = request.tenant
        self.weight[tenant] = request.share_weight
        if self.in_engine[tenant] == 0:  # back after an idle spell: the lift
            others = [self.served.get(t, 0.0) for t, n in self.in_engine.items() if n and t != tenant]
            if others:
                self.served[tenant] = max(self.served.get(tenant, 0.0), min(others))
        self.in_engine[tenant] += 1

    def left(self, request: Request) -> None:
        tenant = request.tenant
        self.in_engine[tenant] -= 1
        if self.in_engine[tenant] <= 0:
            del self.in_engine[tenant]
            if not self.in_engine:  # nobody left to compare with: forget, so the table stays small
                self.served.clear()
                self.weight.clear()

    def charge(self, request: Request, computed_up_to: int, sampled: bool) -> None:
        """The request's tokens computed up to position ``computed_up_to`` (prompt positions not charged
        before) and one output token if ``sampled``."""
        prompt_tokens = max(0, min(computed_up_to, len(request.prompt_token_ids)) - request.num_charged)
        request.num_charged += prompt_tokens
        cost = prompt_tokens * PROMPT_TOKEN_COST + (OUTPUT_TOKEN_COST if sampled else 0.0)
        if cost:
            self.served[request.tenant] = self.served.get(request.tenant, 0.0) + cost / request.share_weight

    def of(self, tenant: str) -> float:
        return self.served.get(tenant, 0.0)


class FairWaitingQueue:
    """The waiting queue by priority class, then VTC across tenants, FCFS within a tenant. Same
    interface as ``scheduler.WaitingQueue``; the counters are the scheduler's (it charges them)."""

    def __init__(self, counters: TenantCounters) -> None:
        self.counters = counters
        self._qs: dict[Priority, dict[str, collections.deque[Request]]] = {p: {} for p in sorted(Priority)}

    def push(self, request: Request) -> None:
        self._qs[request.priority].setdefault(request.tenant, collections.deque()).append(request)

    def push_preempted(self, request: Request) -> None:
        """Back to the head of its tenant's queue, behind preempted requests admitted before it."""
        q = self._qs[request.priority].setdefault(request.tenant, collections.deque())
        i = 0
        while i < len(q) and q[i].admit_seq is not None and q[i].admit_seq < request.admit_seq:
            i += 1
        q.insert(i, request)

    def _tenant_order(self, by_tenant: dict[str, collections.deque[Request]]) -> list[str]:
        # Equal counters (tenants new to the engine, or lifted): the earlier arrival first.
        return sorted(by_tenant, key=lambda t: (self.counters.of(t), by_tenant[t][0].timings.arrival))

    def _head_tenant(self, by_tenant: dict[str, collections.deque[Request]]) -> str | None:
        order = self._tenant_order(by_tenant) if by_tenant else None
        return order[0] if order else None

    def peek(self) -> Request | None:
        for by_tenant in self._qs.values():
            tenant = self._head_tenant(by_tenant)
            if tenant is not None:
                return by_tenant[tenant][0]
        return None

    def pop(self) -> Request:
        for by_tenant in self._qs.values():
            tenant = self._head_tenant(by_tenant)
            if tenant is not None:
                return self._take(by_tenant, tenant, by_tenant[tenant][0])
        raise IndexError("pop from an empty queue")

    def remove(self, request: Request) -> bool:
        by_tenant = self._qs[request.priority]
        if request not in by_tenant.get(request.tenant, ()):
            return False
        self._take(by_tenant, request.tenant, request)
        return True

    def _take(self, by_tenant: dict[str, collections.deque[Request]], tenant: str, request: Request) -> Request:
        q = by_tenant[tenant]
        q.remove(request)
        if not q:
            del by_tenant[tenant]
        return request

    def __len__(self) -> int:
        return sum(len(q) for by_tenant in self._qs.values() for q in by_tenant.values())

    def __iter__(self) -> Iterator[Request]:
        """Class by class, tenants by counter, each tenant's in FCFS order: the head first, then the order
        they would start in if nobody were served meanwhile."""
        for by_tenant in self._qs.values():
            for tenant in self._tenant_order(by_tenant):
                yield from by_tenant[tenant]


def fairness_victim(head: Request, running: list[Request], counters: TenantCounters,
                    starting: list[Request] = ()) -> Request | None:
    """The running request to preempt so that ``head`` (the fair queue's next) can start in a full batch,
    or None. Only a request of the same class, of a tenant that holds more slots than ``head``'s tenant
    would after the swap (weighted) and that was served at least as much (a tenant back from an idle
    spell is lifted to the others' level: equal); its most recently admitted one. ``starting``: requests
    already given a victim's slot in this step (they hold their slots too)."""
    slots = collections.Counter(r.tenant for r in [*running, *starting] if r.priority == head.priority)
    mine = (slots[head.tenant] + 1) / counters.weight.get(head.tenant, head.share_weight)
    over = [t for t in slots if t != head.tenant and slots[t] / counters.weight.get(t, 1.0) > mine
            and counters.of(t) >= counters.of(head.tenant)]
    if not over:
        return None
    tenant = max(over, key=lambda t: (slots[t] / counters.weight.get(t, 1.0), counters.of(t)))
    return max((r for r in running if r.tenant == tenant and r.priority == head.priority),
               key=lambda r: r.admit_seq or 0)
