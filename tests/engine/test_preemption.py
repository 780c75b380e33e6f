"""Lazy KV allocation and preemption (issue 10): when the cache runs out, the lowest-priority, most
recently admitted request is preempted and recomputed later with unchanged output; a preempted
request keeps its place at the head of its class (no starvation). Engine tests use the tiny random
Llama (see conftest); scheduler tests are pure Python with a fake model that always samples 7."""

from __future__ import annotations

import torch

from inference.engine.request import Priority, Request, RequestStatus, SamplingParams
from tests.engine.conftest import hf_greedy
from tests.engine.test_scheduler import make_scheduler, step


def prompts_of(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 256, (n,), generator=g).tolist() for n in lengths]


def test_preempted_requests_recompute_to_the_same_greedy_output(engine_factory, tiny_model):
    """Guards against a preempted request losing or duplicating tokens, or recomputing its cache
    wrongly (positions, its own output tokens as prompt), so that its answer changes."""
    # 3 requests of up to 8 + 24 tokens need 24 blocks of 4 at the end; the cache has 14.
    prompts = prompts_of([8, 6, 9])
    expected = [hf_greedy(tiny_model, p, 24) for p in prompts]
    for prefix_caching in (True, False):
        engine = engine_factory(kv_block_size=4, kv_cache_tokens=56, max_batch=3, max_seq_len=56,
                                prefix_caching=prefix_caching)  # fmt: skip
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
        assert engine.stats().preemptions > 0
        assert outs == expected
        assert engine.allocator.used_tokens == 0


def test_preempted_sampled_request_keeps_its_seeded_output(engine_factory):
    """Guards against a preemption resetting a sampled request's generator (same seed, other text)."""
    p = prompts_of([7], seed=4)[0]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    alone = engine_factory(kv_block_size=4).generate([p], params)[0]
    tight = engine_factory(kv_block_size=4, kv_cache_tokens=56, max_batch=3, max_seq_len=56)
    others = SamplingParams(max_new_tokens=24, ignore_eos=True)
    reqs = [tight.add_request(q, others)[1] for q in prompts_of([8, 6], seed=5)]
    sampled = tight.add_request(p, params)[1]  # admitted last: the first victim
    while tight.has_work():
        tight.step()
    assert sampled.num_preemptions > 0 and all(r.is_finished for r in reqs)
    assert sampled.output_token_ids == alone


def test_lazy_allocation_admits_what_worst_case_reservation_refuses_to_run_together():
    """Guards against reserving prompt + max_new_tokens up front: callers asking for far more
    tokens than they use must still run together."""
    lazy, reserve = make_scheduler(kv_tokens=32, max_batch=4), make_scheduler(kv_tokens=32, max_batch=4, kv_allocation="reserve")
    for s in (lazy, reserve):
        for rid in "abc":
            s.add_group([Request(rid, [1, 2, 3], SamplingParams(max_new_tokens=20, stop_token_ids=frozenset({7})))])
    assert len(step(lazy)[0].admitted) == 3  # 1 block each
    assert len(step(reserve)[0].admitted) == 1  # 6 blocks each of 8


def test_victim_is_lowest_priority_then_most_recently_admitted():
    """Guards against preempting an interactive request to make room for a batch one, or the
    oldest request of a class (which would starve it)."""
    s = make_scheduler(kv_tokens=32, max_batch=4, max_seq_len=64, max_waiting=10)
    s.add_group([Request("batch", [1] * 4, SamplingParams(max_new_tokens=20), Priority.BATCH)])
    s.add_group([Request("chat-old", [2] * 4, SamplingParams(max_new_tokens=20))])
    s.add_group([Request("chat-new", [3] * 4, SamplingParams(max_new_tokens=20))])
    preempted = []
    while not preempted:
        out, _ = step(s)
        preempted = [r.request_id for r in out.preempted]
    assert preempted[0] == "batch"
    while s.get("chat-new").num_preemptions == 0 and s.get("chat-old").num_preemptions == 0:
        step(s)
    assert s.get("chat-new").num_preemptions == 1 and s.get("chat-old").num_preemptions == 0


def test_preempted_request_keeps_its_place_and_is_not_starved():
    """Guards against a preempted request going to the back of the queue (behind later arrivals)
    and being overtaken forever by a stream of new requests."""
    s = make_scheduler(kv_tokens=32, max_batch=2, max_seq_len=64, max_waiting=100)
    s.add_group([Request("a", [1] * 4, SamplingParams(max_new_tokens=20))])
    s.add_group([Request("b", [2] * 4, SamplingParams(max_new_tokens=20))])
    finished, arrivals, b_preempted = [], 0, False
    for _ in range(400):
        if s.num_waiting < 3:  # new work keeps arriving
            s.add_group([Request(f"new{arrivals}", [5] * 4, SamplingParams(max_new_tokens=20))])
            arrivals += 1
        out, done = step(s, token=9)
        b_preempted |= any(r.request_id == "b" for r in out.preempted)
        if b_preempted and s.get("b") is not None and s.get("b").status is RequestStatus.WAITING:
            assert s.waiting.peek().request_id == "b"  # at the head, ahead of every new arrival
        finished += [r.request_id for r in done]
        if "b" in finished:
            break
    assert b_preempted and finished[:2] == ["a", "b"]


def test_cached_tokens_are_what_the_first_admission_took_from_the_cache(engine_factory):
    """Guards against a preempted request reporting the hit of its re-admission (its own prompt and
    output recomputed from blocks it computed itself) as its prompt's cached tokens: the finishing
    event (the final chunk's ``cached_tokens``, OpenAI's usage) says what the prompt took when it was
    first admitted."""
    engine = engine_factory(kv_block_size=4, kv_cache_tokens=56, max_batch=3, max_seq_len=56)
    shared = prompts_of([8], seed=9)[0]
    engine.generate([shared + [5]], SamplingParams(max_new_tokens=1, ignore_eos=True))  # 2 blocks of it cached
    reqs = [engine.add_request(shared + q, SamplingParams(max_new_tokens=24, ignore_eos=True))[1]
            for q in prompts_of([1, 2, 3], seed=5)]
    first: dict[str, int] = {}
    reported: dict[str, int] = {}
    while engine.has_work():
        reported |= {ev.request_id: ev.num_cached_tokens for ev in engine.step() if ev.finished}
        first |= {r.request_id: r.num_cached_tokens for r in reqs
                  if r.admit_seq is not None and r.request_id not in first}
    assert first == {r.request_id: 8 for r in reqs}
    assert any(r.num_preemptions for r in reqs)
    # the re-admissions did hit the cache, for more than the prompts' 8 tokens each
    assert engine.stats().prefix_cache_hit_tokens > sum(first.values())
    assert reported == first and all(r.num_cached_tokens == 8 for r in reqs)
