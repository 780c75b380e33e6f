"""Engine tests on a tiny randomly initialised Llama (2 layers, GQA, float32 CPU; see conftest):
the real step loop, paged cache and attention, without fetching weights. Hugging Face
``generate`` on the same model is the reference."""

from __future__ import annotations

import asyncio

import pytest
import torch

from inference.engine.errors import UnsupportedModelError
from inference.engine.request import Admission, FinishReason, SamplingParams
from inference.engine.streaming import AsyncEngine
from tests.engine.conftest import hf_greedy

GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)


def prompts_of(lengths, seed=1, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("max_step_tokens", [512, 7])
def test_staggered_batch_matches_hf_generate_alone(engine_factory, tiny_model, max_step_tokens):
    """Guards against cross-request leaks in the batch: wrong positions, masks, cache slots or
    prefill chunk boundaries make a request's output differ from generating it alone."""
    engine = engine_factory(max_step_tokens=max_step_tokens, max_batch=3)
    prompts = prompts_of([5, 61, 1, 23, 9, 40])
    reqs = []
    for p in prompts:  # one new arrival per step, while the others decode
        reqs.append(engine.add_request(p, GREEDY)[1])
        engine.step()
    while engine.has_work():
        engine.step()
    for p, r in zip(prompts, reqs):
        assert r.output_token_ids == hf_greedy(tiny_model, p, GREEDY.max_new_tokens)


def test_block_boundaries_and_many_blocks(engine_factory, tiny_model):
    """Guards against off-by-one errors in slot mapping when sequences cross KV block boundaries."""
    engine = engine_factory(kv_block_size=3, max_step_tokens=5)
    prompts = prompts_of([2, 3, 4, 11], seed=5)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert outs == [hf_greedy(tiny_model, p, 8) for p in prompts]


def test_cancel_frees_cache_and_other_requests_continue(engine_factory, tiny_model):
    """Guards against a cancellation that leaks KV blocks or disturbs the requests still running."""
    engine = engine_factory()
    a = engine.add_request(prompts_of([8])[0], SamplingParams(max_new_tokens=50, ignore_eos=True))[1]
    prompt_b = prompts_of([6], seed=2)[0]
    b = engine.add_request(prompt_b, GREEDY)[1]
    engine.step()
    engine.step()
    used_before = engine.allocator.used_tokens
    engine.abort(a.request_id)
    events = engine.step()
    assert any(e.request_id == a.request_id and e.finish_reason is FinishReason.ABORTED for e in events)
    assert engine.allocator.used_tokens < used_before and a.request_id not in engine.allocator._tables
    while engine.has_work():
        engine.step()
    assert b.output_token_ids == hf_greedy(tiny_model, prompt_b, GREEDY.max_new_tokens)
    assert engine.allocator.used_tokens == 0


def test_eos_stops_unless_ignored(engine_factory, tiny_model):
    """Guards against ignoring the model's end-of-sequence id (or a caller's stop ids)."""
    engine = engine_factory()
    prompt = prompts_of([7])[0]
    first = hf_greedy(tiny_model, prompt, 3)
    out = engine.generate([prompt], SamplingParams(max_new_tokens=10, stop_token_ids=frozenset({first[2]})))
    assert out[0] == first[:3]


def test_refusals_come_back_as_results(engine_factory):
    """Guards against the engine raising or queueing when it should answer OVERLOADED / TOO_LARGE."""
    engine = engine_factory(max_waiting=1, kv_cache_tokens=64, max_seq_len=64)
    assert engine.add_request([1] * 60, SamplingParams(max_new_tokens=10))[0] is Admission.TOO_LARGE
    assert engine.add_request([1, 2], GREEDY)[0] is Admission.ACCEPTED
    assert engine.add_request([1, 2], GREEDY)[0] is Admission.OVERLOADED
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([10_000], GREEDY)


def test_stats_count_tokens_and_cache(engine_factory):
    """Guards against counters that do not move (running, cache use, tokens generated)."""
    engine = engine_factory()
    engine.add_request([1, 2, 3], GREEDY)
    engine.step()
    s = engine.stats()
    assert s.running == 1 and s.kv_used_tokens > 0 and s.prompt_tokens == 3 and s.generated_tokens == 1
    while engine.has_work():
        engine.step()
    s = engine.stats()
    assert s.running == 0 and s.kv_used_tokens == 0 and s.generated_tokens == GREEDY.max_new_tokens


def test_unsupported_architecture_is_refused(engine_factory):
    """Guards against running a model whose attention the runner does not implement (wrong output)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="supported: llama"):
        engine_factory(model=gpt2)


async def test_async_stream_yields_tokens_then_finish(engine_factory, tiny_model):
    """Guards against a stream that drops, reorders or never ends its tokens."""
    prompts = prompts_of([4, 12])
    async with AsyncEngine(engine_factory()) as aengine:
        streams = [aengine.submit(p, GREEDY) for p in prompts]

        async def collect(stream):
            return [ev async for ev in stream]

        results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)
    for p, events in zip(prompts, results):
        assert [e.token_id for e in events] == hf_greedy(tiny_model, p, GREEDY.max_new_tokens)
        assert events[-1].finished and events[-1].finish_reason is FinishReason.LENGTH
        assert events[-1].timings.ttft is not None


async def test_leaving_the_stream_early_cancels_the_request(engine_factory):
    """Guards against a client that goes away leaving its generation running and its cache held."""
    engine = engine_factory()
    async with AsyncEngine(engine) as aengine:
        stream = aengine.submit([1, 2, 3], SamplingParams(max_new_tokens=400, ignore_eos=True))
        async for _ in stream:
            break
        for _ in range(200):
            if engine.allocator.used_tokens == 0:
                break
            await asyncio.sleep(0.01)
    assert engine.allocator.used_tokens == 0 and engine.scheduler.num_running == 0
