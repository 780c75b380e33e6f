"""Scheduler unit tests: pure Python, no model, no torch. A fake clock and hand-made token ids
stand in for the model; ``step`` plays the engine's role of feeding sampled tokens back."""

from __future__ import annotations

import pytest

from inference.engine.block_allocator import BlockAllocator
from inference.engine.request import Admission, FinishReason, Priority, Request, RequestStatus, SamplingParams
from inference.engine.scheduler import Scheduler, SchedulerConfig


def make_scheduler(kv_tokens=64, block=4, prefix_caching=True, **cfg) -> Scheduler:
    base = dict(max_batch=2, max_seq_len=64, max_step_tokens=16, max_waiting=3)
    base.update(cfg)
    ticks = iter(range(10_000))
    allocator = BlockAllocator(kv_tokens // block, block, prefix_caching=prefix_caching)
    return Scheduler(SchedulerConfig(**base), allocator, clock=lambda: float(next(ticks)))


def req(rid: str, prompt_len=4, max_new=3, priority=Priority.INTERACTIVE, stop=frozenset()) -> Request:
    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=stop)
    return Request(rid, list(range(1, prompt_len + 1)), params, priority)


def step(s: Scheduler, token: int = 7):
    """One engine step with a fake model that always samples ``token``."""
    out = s.schedule()
    sampled = {c.request.request_id: token for c in out.chunks if c.sample}
    return out, s.update_from_output(out, sampled)


def test_interactive_admitted_before_batch_even_if_later():
    """Guards against FCFS across classes: a batch job queued first must not delay an interactive one."""
    s = make_scheduler(max_batch=1)
    assert s.add_group([req("batch", priority=Priority.BATCH)]) is Admission.ACCEPTED
    assert s.add_group([req("chat", priority=Priority.INTERACTIVE)]) is Admission.ACCEPTED
    out, _ = step(s)
    assert [r.request_id for r in out.admitted] == ["chat"]


def test_fcfs_inside_a_priority_class():
    """Guards against a queue that reorders requests of the same class (e.g. LIFO or by size)."""
    s = make_scheduler(max_batch=1)
    for rid in ("a", "b", "c"):
        s.add_group([req(rid, priority=Priority.BATCH)])
    admitted = []
    while s.has_work():
        out, _ = step(s)
        admitted += [r.request_id for r in out.admitted]
    assert admitted == ["a", "b", "c"]


def test_full_queue_refuses_with_overloaded_and_does_not_grow():
    """Guards against an unbounded waiting queue: past max_waiting, work is refused, not queued."""
    s = make_scheduler(max_waiting=3)
    results = [s.add_group([req(f"r{i}")]) for i in range(5)]
    assert results == [Admission.ACCEPTED] * 3 + [Admission.OVERLOADED] * 2
    assert s.num_waiting == 3


def test_request_larger_than_the_cache_is_refused_at_admission():
    """Guards against a request that can never fit sitting at the head of the queue forever."""
    s = make_scheduler(kv_tokens=32, max_seq_len=1000)
    assert s.add_group([req("huge", prompt_len=30, max_new=10)]) is Admission.TOO_LARGE
    assert s.add_group([req("fits", prompt_len=20, max_new=10)]) is Admission.ACCEPTED
    assert s.num_waiting == 1


def test_request_longer_than_max_seq_len_is_refused():
    """Guards against admitting prompt + max_new_tokens beyond the per-request length limit."""
    s = make_scheduler(kv_tokens=1024, max_seq_len=16)
    assert s.add_group([req("long", prompt_len=10, max_new=7)]) is Admission.TOO_LARGE


def test_finished_requests_retire_and_waiting_ones_refill_the_batch():
    """Guards against a batch that only refills when it is empty (static batching)."""
    s = make_scheduler(max_batch=2)
    s.add_group([req("short", max_new=1)])
    s.add_group([req("long", max_new=5)])
    s.add_group([req("next", max_new=2)])
    out, finished = step(s)  # prefill of both; "short" finishes with its first token
    assert {r.request_id for r in out.admitted} == {"short", "long"}
    assert [r.request_id for r in finished] == ["short"]
    assert "short" not in s.allocator._tables
    out, _ = step(s)  # "next" joins while "long" decodes
    assert [r.request_id for r in out.admitted] == ["next"]
    assert {c.request.request_id for c in out.chunks} == {"long", "next"}


def test_waits_for_kv_room_instead_of_overcommitting():
    """Guards against admitting more worst-case reservations than the KV budget holds (reserve mode)."""
    s = make_scheduler(kv_tokens=16, block=4, max_batch=4, kv_allocation="reserve")
    s.add_group([req("a", prompt_len=4, max_new=4)])  # 8 tokens
    s.add_group([req("b", prompt_len=4, max_new=4)])  # 8 tokens
    s.add_group([req("c", prompt_len=4, max_new=4)])  # must wait
    out, _ = step(s)
    assert [r.request_id for r in out.admitted] == ["a", "b"]
    assert s.allocator.num_free_blocks == 0
    while s.get("c").status is RequestStatus.WAITING:
        step(s)
    assert s.get("c").status is RequestStatus.RUNNING


def test_cancel_running_request_frees_its_cache_at_next_step():
    """Guards against cancelled requests keeping their KV blocks (a leak under client disconnects)."""
    s = make_scheduler()
    s.add_group([req("a", max_new=10)])
    step(s)
    assert "a" in s.allocator._tables
    assert s.abort("a") is True
    out, _ = step(s)
    assert [r.request_id for r in out.finished] == ["a"]
    assert out.finished[0].finish_reason is FinishReason.ABORTED
    assert "a" not in s.allocator._tables and s.num_running == 0
    assert out.chunks == []


def test_cancel_waiting_request_removes_it_from_the_queue():
    """Guards against a cancelled request still being admitted later."""
    s = make_scheduler(max_batch=1)
    s.add_group([req("a", max_new=10)])
    s.add_group([req("b")])
    step(s)
    s.abort("b")
    out, _ = step(s)
    assert [r.request_id for r in out.finished] == ["b"] and s.num_waiting == 0
    assert s.abort("b") is False


def test_long_prompt_is_chunked_and_decodes_keep_running():
    """Guards against a long prompt taking the whole step and stalling running generations."""
    # No prefix cache: both prompts start 1, 2, 3, 4 and "long" would reuse that block.
    s = make_scheduler(kv_tokens=256, max_step_tokens=8, max_batch=2, max_seq_len=256, prefix_caching=False)
    s.add_group([req("running", prompt_len=4, max_new=20)])
    step(s)
    s.add_group([req("long", prompt_len=30, max_new=2)])
    chunks_seen = []
    for _ in range(5):
        out, _ = step(s)
        by_id = {c.request.request_id: c for c in out.chunks}
        assert by_id["running"].num_new_tokens == 1  # decoded every step
        assert sum(c.num_new_tokens for c in out.chunks) <= 8
        if "long" in by_id:
            chunks_seen.append((by_id["long"].start, by_id["long"].num_new_tokens, by_id["long"].sample))
    assert chunks_seen[:4] == [(0, 7, False), (7, 7, False), (14, 7, False), (21, 7, False)]
    assert chunks_seen[4] == (28, 2, True)


def test_stop_token_and_max_new_tokens_finish_with_their_reason():
    """Guards against generating past a stop token id or past max_new_tokens."""
    s = make_scheduler()
    s.add_group([req("stops", max_new=10, stop=frozenset({7}))])
    s.add_group([req("runs", max_new=3)])
    _, finished = step(s, token=7)
    assert [(r.request_id, r.finish_reason) for r in finished] == [("stops", FinishReason.STOP)]
    done = []
    while s.has_work():
        done += step(s, token=5)[1]
    assert done[0].finish_reason is FinishReason.LENGTH and done[0].output_token_ids == [7, 5, 5]


def test_timings_are_recorded_in_order():
    """Guards against missing or inverted queue / first-token / finish timestamps."""
    s = make_scheduler()
    r = req("a", max_new=2)
    s.add_group([r])
    while s.has_work():
        step(s)
    t = r.timings
    assert t.arrival < t.admitted < t.first_token < t.finished
    assert t.queue_time > 0 and t.ttft > t.queue_time and t.tpot(2) > 0


def test_duplicate_request_id_is_rejected():
    """Guards against two streams sharing one id (their tokens would interleave)."""
    s = make_scheduler()
    s.add_group([req("a")])
    with pytest.raises(ValueError):
        s.add_group([req("a")])


def test_load_counts_the_budgets_of_waiting_and_running_requests():
    """What a worker reports for the gateway's wait estimate (inference/worker/heartbeat.py): prompt tokens
    not computed and output tokens not generated yet, of the waiting and of the running requests."""
    s = make_scheduler(kv_tokens=256, max_batch=2, max_step_tokens=16)
    for rid in ("a", "b", "c"):
        s.add_group([req(rid, prompt_len=4, max_new=5)])
    assert (s.load().queued_prompt_tokens, s.load().queued_output_tokens, s.load().running_output_tokens) == (12, 15, 0)
    step(s)  # a and b run (prompts computed, one token each); c waits
    load = s.load()
    assert (load.queued_prompt_tokens, load.queued_output_tokens, load.running_output_tokens) == (4, 5, 8)


def test_an_interactive_request_takes_a_running_batch_requests_slot_at_once():
    """Guards the Batch API's promise (issue 44): the batch class fills what interactive traffic leaves and
    yields to it. A full batch of batch-class generations used to make an interactive request wait until one
    ended (its TTFT 7x its TTFT alone in bench/batch.py); now the batch request admitted last is preempted
    (recomputed later from its cached blocks) and the interactive prompt runs in the next step, alone."""
    for policy in ("fair", "priority"):
        s = make_scheduler(kv_tokens=256, max_batch=2, max_waiting=8, queue_policy=policy)
        s.add_group([req("b0", max_new=20, priority=Priority.BATCH)])
        s.add_group([req("b1", max_new=20, priority=Priority.BATCH)])
        for _ in range(3):
            step(s)
        s.add_group([req("chat", max_new=2)])
        out, _ = step(s)
        assert [r.request_id for r in out.admitted] == ["chat"] and [r.request_id for r in out.preempted] == ["b1"]
        assert [c.request.request_id for c in out.chunks] == ["chat"], "the room made is for the interactive prompt"
        assert s.num_priority_preemptions == 1 and s.num_fairness_preemptions == 0
        finished = []
        for _ in range(40):
            finished += [r.request_id for r in step(s)[1]]
        assert finished[0] == "chat" and sorted(finished) == ["b0", "b1", "chat"], finished


def test_no_preemption_within_a_class_nor_under_fcfs():
    """An interactive request behind running interactive ones waits for a slot (no preemption within a class);
    ``fcfs`` ignores classes altogether (bench/engine.py's baseline)."""
    s = make_scheduler(kv_tokens=256, max_batch=2, max_waiting=8)
    s.add_group([req("i0", max_new=20)])
    s.add_group([req("i1", max_new=20)])
    step(s)
    s.add_group([req("late", max_new=2)])
    out, _ = step(s)
    assert out.preempted == [] and out.admitted == [] and s.num_priority_preemptions == 0
    f = make_scheduler(kv_tokens=256, max_batch=2, max_waiting=8, queue_policy="fcfs")
    f.add_group([req("b0", max_new=20, priority=Priority.BATCH)])
    f.add_group([req("b1", max_new=20, priority=Priority.BATCH)])
    step(f)
    f.add_group([req("chat", max_new=2)])
    out, _ = step(f)
    assert out.preempted == [] and f.num_priority_preemptions == 0
