"""Stop strings end a request at the step whose token completes them (issue 10; before, a caller
cancelled from its own thread and the engine computed at least one more step). Tiny random Llama
(see conftest) with a character tokenizer: token id i is the character U+0400 + i, so any two
consecutive output tokens form a stop string that first completes at a known token."""

from __future__ import annotations

import asyncio

from inference.engine.request import FinishReason, SamplingParams
from inference.engine.streaming import AsyncEngine, stream_text
from inference.engine.text import TextStream
from tests.engine.conftest import hf_greedy

PARAMS = SamplingParams(max_new_tokens=30, ignore_eos=True)
PROMPT = [5, 17, 200, 3, 99, 41]


class CyrillicTokenizer:
    """One printable character per token id (a real tokenizer is not needed for the step logic)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x400 + i) for i in ids)


def stop_case(model) -> tuple[str, int, str]:
    """A two-character stop string from the reference output, the index of the token that first
    completes it, and the text before it."""
    ref = hf_greedy(model, PROMPT, PARAMS.max_new_tokens)
    text = CyrillicTokenizer().decode(ref)
    for k in range(4, len(text)):
        stop = text[k - 1 : k + 1]
        if stop not in text[:k]:
            return stop, k, text[: k - 1]
    raise AssertionError("no usable stop string in the reference output")


def test_engine_ends_the_request_at_the_token_completing_the_stop_string(engine_factory, tiny_model):
    """Guards against computing tokens after a stop string matched (the old one-step-late stop)
    and against showing any part of the stop string."""
    stop, k, before = stop_case(tiny_model)
    engine = engine_factory()
    _, req = engine.add_request(PROMPT, PARAMS, text_stream=TextStream(CyrillicTokenizer(), [stop]))
    events = []
    while engine.has_work():
        events += engine.step()
    assert req.finish_reason is FinishReason.STOP
    assert len(req.output_token_ids) == k + 1  # the token completing the stop string is the last one
    assert engine.stats().generated_tokens == k + 1  # and no step computed another
    assert "".join(e.text for e in events) == before and events[-1].finished
    assert engine.allocator.used_tokens == 0


async def test_stream_text_stops_in_the_same_step(engine_factory, tiny_model):
    """Guards against the asyncio path (stream_text) letting the engine run on after the stop."""
    stop, k, before = stop_case(tiny_model)
    engine = engine_factory()
    async with AsyncEngine(engine) as aengine:
        deltas = [d async for d in stream_text(aengine, CyrillicTokenizer(), PROMPT, PARAMS, stop=[stop])]
        await asyncio.sleep(0.2)  # a late step would have run by now
    assert "".join(d.text for d in deltas) == before
    assert deltas[-1].finish_reason is FinishReason.STOP and deltas[-1].num_output_tokens == k + 1
    assert engine.stats().generated_tokens == k + 1


def test_text_stream_without_a_match_returns_held_text_at_the_end(engine_factory, tiny_model):
    """Guards against text held back as a possible stop-string start being lost at the end."""
    engine = engine_factory()
    ref_text = CyrillicTokenizer().decode(hf_greedy(tiny_model, PROMPT, 6))
    stop = ref_text[-1] + "\u0300"  # starts with the last character, never completes
    _, req = engine.add_request(PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True),
                                text_stream=TextStream(CyrillicTokenizer(), [stop]))  # fmt: skip
    events = []
    while engine.has_work():
        events += engine.step()
    assert "".join(e.text for e in events) == ref_text and req.finish_reason is FinishReason.LENGTH
