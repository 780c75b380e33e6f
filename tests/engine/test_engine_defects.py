"""Defects found by reading ``inference/engine/`` (issue 7, item 9), each pinned by a test on the tiny
random Llama (see conftest): a failing step, stop() with open streams, a consumer whose event loop
is gone, named errors for refusals and bad requests, and the process-wide RNG left alone."""

from __future__ import annotations

import asyncio

import pytest
import torch

from inference.engine.engine import Engine
from inference.engine.errors import EngineError, EngineFailed, EngineStopped, InvalidRequestError, RequestRefused
from inference.engine.request import Admission, FinishReason, SamplingParams
from inference.engine.settings import EngineSettings
from inference.engine.streaming import AsyncEngine, stream_text
from schemas.errors import ChatpipeError
from tests.engine.conftest import make_tiny_model

SETTINGS = dict(device="cpu", dtype="float32", kv_cache_tokens=2048, kv_block_size=4, max_step_tokens=32, max_batch=4)
LONG = SamplingParams(max_new_tokens=480, ignore_eos=True)


def nan_engine() -> Engine:
    """A real engine whose model gives NaN logits: sampling then fails inside ``step()`` the way a
    numerical blow-up does (torch.multinomial raises on NaN probabilities). No mock involved."""
    model = make_tiny_model(seed=3)
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    return Engine(model, EngineSettings(**SETTINGS))


async def drain(stream, timeout: float = 60.0) -> list:
    async def collect():
        return [ev async for ev in stream]

    return await asyncio.wait_for(collect(), timeout)


async def test_step_failure_reaches_every_waiting_caller_as_a_named_error():
    """Guards against a failing step ending the step thread and leaving callers with a bare
    exception (or nothing): each open stream raises EngineFailed naming the cause."""
    aengine = AsyncEngine(nan_engine())
    sampled = aengine.submit([5, 6, 7], SamplingParams(max_new_tokens=5, temperature=1.0))
    greedy = aengine.submit([8, 9], SamplingParams(max_new_tokens=5))  # shares the failing step
    aengine.start()
    try:
        for stream in (sampled, greedy):
            with pytest.raises(EngineFailed, match="probability tensor") as info:
                await drain(stream)
            assert isinstance(info.value.__cause__, RuntimeError)
        assert aengine.failed and isinstance(aengine.failure, EngineFailed)
    finally:
        await asyncio.to_thread(aengine.stop)


async def test_submit_after_a_step_failure_raises_instead_of_waiting_forever():
    """Guards against later submits hanging on a dead step thread."""
    aengine = AsyncEngine(nan_engine())
    first = aengine.submit([5, 6, 7], SamplingParams(max_new_tokens=5, temperature=1.0))
    aengine.start()
    try:
        with pytest.raises(EngineFailed):
            await drain(first)
        with pytest.raises(EngineFailed, match="failed"):
            aengine.submit([1, 2], SamplingParams(max_new_tokens=3))
        with pytest.raises(EngineFailed):  # stream_text too, and before touching the tokenizer
            await asyncio.wait_for(anext(stream_text(aengine, None, [1, 2])), 10)
    finally:
        await asyncio.to_thread(aengine.stop)


async def test_stop_ends_every_open_stream_and_frees_its_cache(engine_factory):
    """Guards against stop() leaving a running and a waiting stream without a final event, and
    their KV reservations held in the engine."""
    engine = engine_factory(max_batch=1)
    aengine = AsyncEngine(engine)
    running = aengine.submit([1, 2, 3], LONG)
    waiting = aengine.submit([4, 5], LONG)  # queued behind it (max_batch=1)
    aengine.start()
    events = running.__aiter__()
    first = await asyncio.wait_for(anext(events), 60)
    assert not first.finished
    await asyncio.to_thread(aengine.stop)

    async def until_the_end(stream_events):  # tokens posted before stop() may come first
        async for ev in stream_events:
            assert not ev.finished

    for stream_events in (events, waiting.__aiter__()):
        with pytest.raises(EngineStopped):
            await asyncio.wait_for(until_the_end(stream_events), 10)
    with pytest.raises(EngineStopped):
        aengine.submit([1], LONG)
    while engine.has_work():  # the aborts stop() queued are applied at the next step, which computes nothing
        assert all(ev.finish_reason is FinishReason.ABORTED for ev in engine.step())
    assert engine.allocator.used_tokens == 0


async def test_stop_before_start_ends_submitted_streams(engine_factory):
    """Guards against a stream that waits forever because its engine was stopped before it ran."""
    aengine = AsyncEngine(engine_factory())
    stream = aengine.submit([1, 2, 3], LONG)
    aengine.stop()
    with pytest.raises(EngineStopped):
        await drain(stream, timeout=10)


def test_a_consumer_whose_event_loop_closed_does_not_kill_the_engine(engine_factory):
    """Guards against the step thread dying when it hands a token to an event loop that has
    closed (a caller that submitted and went away): other callers must still be served."""
    aengine = AsyncEngine(engine_factory())
    aengine.start()
    try:

        async def submit_and_leave():
            aengine.submit([1, 2, 3], SamplingParams(max_new_tokens=200, ignore_eos=True))

        asyncio.run(submit_and_leave())  # that loop is closed now; its request is still running

        async def served():
            return await drain(aengine.submit([4, 5], SamplingParams(max_new_tokens=4, ignore_eos=True)))

        events = asyncio.run(served())
        assert events[-1].finished and len(events) == 4 and not aengine.failed
    finally:
        aengine.stop()


def test_engine_errors_are_chatpipe_errors_and_keep_their_old_bases():
    """Guards against engine errors escaping the CLI's named-error handler (a traceback), and
    against breaking callers that caught the old ValueError / RuntimeError."""
    for cls in (EngineError, EngineFailed, EngineStopped, InvalidRequestError, RequestRefused):
        assert issubclass(cls, ChatpipeError)
    assert issubclass(InvalidRequestError, ValueError) and issubclass(RequestRefused, RuntimeError)


async def test_refused_request_raises_request_refused_with_counts_and_limit(engine_factory):
    """Guards against a bare RuntimeError('request refused: too_large') that says neither how big
    the request was nor what the limit is."""
    async with AsyncEngine(engine_factory(kv_cache_tokens=64, max_seq_len=64)) as aengine:
        with pytest.raises(RequestRefused) as info:
            await anext(stream_text(aengine, None, [1] * 60, SamplingParams(max_new_tokens=10)))
    err = info.value
    assert (err.admission, err.num_prompt_tokens, err.max_new_tokens, err.limit) == (Admission.TOO_LARGE, 60, 10, 64)
    assert "60 prompt tokens" in str(err) and "64" in str(err)


async def test_overloaded_refusal_names_the_queue_bound(engine_factory):
    """Guards against an OVERLOADED refusal that does not tell the caller to retry later."""
    async with AsyncEngine(engine_factory(max_waiting=0)) as aengine:
        stream = aengine.submit([1, 2], SamplingParams(max_new_tokens=2))
        assert stream.admission is Admission.OVERLOADED and isinstance(stream.refusal, RequestRefused)
        with pytest.raises(RequestRefused, match="retry later"):
            await anext(stream_text(aengine, None, [1, 2], SamplingParams(max_new_tokens=2)))


def test_bad_requests_raise_a_named_error(engine_factory):
    """Guards against an empty prompt or out-of-vocabulary ids surfacing as a bare ValueError."""
    engine = engine_factory()
    with pytest.raises(InvalidRequestError, match="no tokens"):
        engine.add_request([], SamplingParams())
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request([10_000], SamplingParams())
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)


def test_building_and_running_an_engine_leaves_the_global_rng_alone(engine_factory):
    """Guards against the engine reseeding torch's process-wide RNG (torch.seed()), which breaks
    every other seeded computation in the process."""
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    engine = engine_factory()
    # An unseeded sampled request: its seed comes from the engine's own seeder.
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, temperature=1.0))
    assert torch.equal(torch.rand(4), expected)
