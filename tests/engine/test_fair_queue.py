"""The fair share among tenants (inference/engine/fair_queue.py) on the scheduler: pure Python, no
model. A fake clock and hand-made token ids stand in for the model, as in test_scheduler.py."""

from __future__ import annotations

import collections

from inference.engine.request import Priority, Request, SamplingParams
from inference.engine.scheduler import Scheduler
from tests.engine.test_scheduler import make_scheduler, step


def req(rid: str, tenant: str, prompt_len=4, max_new=3, weight=1.0, priority=Priority.INTERACTIVE) -> Request:
    return Request(rid, [hash((rid, i)) % 1000 + 1 for i in range(prompt_len)], SamplingParams(max_new_tokens=max_new),
                   priority, tenant=tenant, share_weight=weight)


def run(s: Scheduler, steps: int) -> collections.Counter:
    """Service per tenant over ``steps`` engine steps, as VTC counts it: prompt tokens computed (once) plus
    twice the output tokens."""
    served: collections.Counter = collections.Counter()
    for _ in range(steps):
        out, _ = step(s)
        for chunk in out.chunks:
            prompt = len(chunk.request.prompt_token_ids)
            served[chunk.request.tenant] += max(0, min(chunk.start + chunk.num_new_tokens, prompt) - chunk.start)
            served[chunk.request.tenant] += 2 * chunk.sample
    return served


def keep_queued(s: Scheduler, tenant: str, n: int, counter, **kw) -> None:
    """Closed loop: the tenant always has ``n`` requests in the engine (a client that sends the next at once)."""
    while sum(1 for r in s._by_id.values() if r.tenant == tenant) < n:
        s.add_group([req(f"{tenant}{next(counter)}", tenant, **kw)])


def test_a_tenant_of_short_requests_is_served_before_a_backlog_of_long_ones():
    """Guards against FCFS across tenants: a light tenant's request that arrives behind a heavy tenant's
    backlog of long generations starts at the next free slot, not after the backlog."""
    s = make_scheduler(max_batch=2, kv_tokens=1024, max_waiting=64)
    for i in range(6):
        s.add_group([req(f"heavy{i}", "heavy", max_new=20)])
    run(s, 5)  # heavy's first two run, heavy has been served, four wait
    s.add_group([req("light0", "light", max_new=2)])
    admitted = []
    for _ in range(3):
        out, _ = step(s)
        admitted += [r.request_id for r in out.admitted]
    assert admitted and admitted[0] == "light0", admitted


def test_fcfs_within_a_tenant_and_the_fcfs_policy_keeps_arrival_order():
    """Guards against the fair queue reordering one tenant's own requests, and against ``fcfs`` /
    ``priority`` losing their old order (they are the bench's baselines)."""
    for policy in ("fair", "priority", "fcfs"):
        s = make_scheduler(max_batch=1, kv_tokens=1024, max_waiting=64, queue_policy=policy)
        for i in range(4):
            s.add_group([req(f"a{i}", "a", max_new=1)])
        admitted = []
        while s.has_work():
            out, _ = step(s)
            admitted += [r.request_id for r in out.admitted]
        assert admitted == ["a0", "a1", "a2", "a3"], policy


def test_a_full_batch_makes_room_for_a_tenant_under_its_share():
    """Guards against a light tenant waiting for a heavy tenant's long generations to end: with every slot
    taken by the heavy tenant, the light one's request preempts the heavy one's most recent and starts at
    once, in a step of its own; the preempted request keeps its output and finishes later."""
    s = make_scheduler(max_batch=4, kv_tokens=1024, max_waiting=64)
    for i in range(4):
        s.add_group([req(f"heavy{i}", "heavy", max_new=40)])
    run(s, 5)
    victim_output = list(s.get("heavy3").output_token_ids)
    s.add_group([req("light0", "light", max_new=2)])
    out, _ = step(s)
    assert [r.request_id for r in out.admitted] == ["light0"]
    assert [r.request_id for r in out.preempted] == ["heavy3"]
    assert [c.request.request_id for c in out.chunks] == ["light0"]  # its prompt alone: no batch of decodes to wait for
    assert s.num_fairness_preemptions == 1
    assert s.get("heavy3").output_token_ids == victim_output  # kept; recomputed when it runs again
    while s.has_work():
        step(s)
    assert s.num_fairness_preemptions == 1  # no swapping back and forth


def test_requests_under_their_share_that_arrive_together_start_in_one_step():
    """Guards against a burst of a light tenant's requests starting one step apart (each waiting for a full
    batch's step on a CPU) when each has a slot to take; and against taking more than the tenant's share."""
    s = make_scheduler(max_batch=4, kv_tokens=1024, max_waiting=64)
    for i in range(4):
        s.add_group([req(f"heavy{i}", "heavy", max_new=40)])
    run(s, 5)
    for i in range(3):
        s.add_group([req(f"light{i}", "light", max_new=2)])
    out, _ = step(s)
    # 2 of 4 slots each: the third light request waits (heavy would then hold fewer than light)
    assert [r.request_id for r in out.admitted] == ["light0", "light1"]
    assert sorted(r.request_id for r in out.preempted) == ["heavy2", "heavy3"]


def test_no_preemption_for_the_batch_class_nor_within_one_tenant():
    """Guards against fairness preempting across priority classes (capacity.py's reserve does that job) or a
    tenant preempting itself."""
    s = make_scheduler(max_batch=2, kv_tokens=1024, max_waiting=64)
    for i in range(2):
        s.add_group([req(f"heavy{i}", "heavy", max_new=30)])
    run(s, 3)
    s.add_group([req("batchjob", "light", max_new=2, priority=Priority.BATCH)])
    s.add_group([req("heavy2", "heavy", max_new=2)])
    run(s, 3)
    assert s.num_fairness_preemptions == 0


def test_competing_tenants_share_tokens_by_weight_not_by_requests():
    """Guards against counting requests: a tenant of long generations and one of short ones, both always
    backlogged, are served about equally (prompt tokens + 2 x output tokens); with weight 3 against 1,
    about three to one. Counting requests would give the long one ~15x the short one's service."""
    for weights, expected in (((1.0, 1.0), 1.0), ((3.0, 1.0), 3.0)):
        s = make_scheduler(max_batch=4, kv_tokens=4096, max_waiting=256, max_seq_len=256)
        ids = iter(range(100_000))
        served: collections.Counter = collections.Counter()
        for _ in range(600):
            keep_queued(s, "long", 8, ids, max_new=60, weight=weights[0])
            keep_queued(s, "short", 8, ids, max_new=4, weight=weights[1])
            served += run(s, 1)
        ratio = served["long"] / served["short"]
        assert abs(ratio - expected) / expected < 0.15, (weights, served)


def test_a_tenant_alone_gets_everything_however_much_it_was_served():
    """Guards against a non-work-conserving share: a tenant that was served a lot, then alone, runs a full
    batch; and one that comes back after an idle spell is lifted to the others' level instead of
    starving them with banked credit."""
    s = make_scheduler(max_batch=4, kv_tokens=4096, max_waiting=256, max_seq_len=256)
    ids = iter(range(100_000))
    for _ in range(200):
        keep_queued(s, "a", 8, ids, max_new=20)
        keep_queued(s, "b", 8, ids, max_new=20)
        run(s, 1)
    while any(r.tenant == "b" for r in s._by_id.values()):  # b goes idle: a alone fills the batch
        keep_queued(s, "a", 8, ids, max_new=20)
        run(s, 1)
    keep_queued(s, "a", 8, ids, max_new=20)
    run(s, 2)
    assert [r.tenant for r in s.running] == ["a"] * 4
    served_a = s.counters.of("a")
    s.add_group([req("b-back", "b", max_new=20)])  # b returns: lifted to a's level, not left far below
    assert s.counters.of("b") == served_a


def test_the_workers_metrics_count_the_fairness_preemptions_apart():
    """Guards against the fair share's preemptions hiding among the KV-room ones (an operator reading
    chatpipe:num_preemptions would take a fair share at work for a cache too small)."""
    from types import SimpleNamespace

    from inference.worker.metrics import WorkerMetrics

    metrics = WorkerMetrics("m")

    def stats(preemptions: int, fairness: int, priority: int = 0) -> SimpleNamespace:
        return SimpleNamespace(running=1, waiting=0, kv_usage=0.5, tokens_per_s=1.0, prefix_cache_queried_tokens=0,
                               prefix_cache_hit_tokens=0, preemptions=preemptions, fairness_preemptions=fairness,
                               priority_preemptions=priority)

    metrics.engine(stats(3, 1), 1)
    metrics.engine(stats(5, 2, 1), 1)
    value = metrics.registry.get_sample_value
    assert value("chatpipe:num_preemptions_total", {"model_name": "m"}) == 5
    assert value("chatpipe:num_fairness_preemptions_total", {"model_name": "m"}) == 2
    assert value("chatpipe:num_priority_preemptions_total", {"model_name": "m"}) == 1
