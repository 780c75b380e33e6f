"""POST /v1/completions with the official ``openai`` client, through the real pipeline (broker,
streams, the inference worker with the default model; no mocks): the raw prompt reaches the model
as it is, so the answer at temperature 0 is Hugging Face's greedy continuation of exactly that
text (``tests/engine``'s reference), not of a chat template around it.

Guards against: the prompt wrapped in the chat template or a system prompt, memory recalled into
it, a list prompt answered as one request (or its choices out of order), a stream that differs
from the plain answer, logprobs that do not belong to the text, unknown fields accepted.
"""

from __future__ import annotations

import math
import uuid

import openai
import pytest

from chatpipe.testing.gateway import API_KEY

pytestmark = [pytest.mark.integration, pytest.mark.model]
MODEL = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n   "]


@pytest.fixture(scope="module")
def client(pipeline):
    return openai.OpenAI(base_url=f"{pipeline.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def greedy():
    """``greedy(text, n)``: the default model's greedy continuation of the raw text (HF generate,
    float32 on CPU like the test worker), decoded as the worker decodes; and its prompt length."""
    from inference.engine.model_store import load_model
    from inference.engine.settings import EngineSettings
    from tests.engine.conftest import hf_greedy

    model, tokenizer = load_model(EngineSettings(device="cpu", dtype="float32", kv_cache_tokens=256))
    cache = {}

    def run(text: str, max_tokens: int) -> tuple[str, int]:
        if (text, max_tokens) not in cache:
            ids = tokenizer.encode(text)  # tokenizer(text), as HF and vLLM encode a completion prompt
            out = hf_greedy(model, ids, max_tokens, eos=tokenizer.eos_token_id)
            cache[text, max_tokens] = tokenizer.decode(out, skip_special_tokens=True), len(ids)
        return cache[text, max_tokens]

    return run


def test_the_answer_is_the_greedy_continuation_of_the_raw_prompt(client, greedy):
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    expected, prompt_tokens = greedy(PROMPTS[0], 8)
    assert answer.object == "text_completion" and answer.id.startswith("cmpl-")
    assert len(answer.choices) == 1 and answer.choices[0].index == 0
    assert answer.choices[0].text == expected, (answer.choices[0].text, expected)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].logprobs is None
    assert answer.usage.prompt_tokens == prompt_tokens  # no template, no system prompt, nothing recalled
    assert 0 < answer.usage.completion_tokens <= 8


def test_a_list_prompt_gives_one_choice_per_prompt(client, greedy):
    answer = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.index for c in answer.choices] == [0, 1]
    assert [c.text for c in answer.choices] == [greedy(p, 8)[0] for p in PROMPTS]
    assert answer.usage.prompt_tokens == sum(greedy(p, 8)[1] for p in PROMPTS)


def test_a_stream_with_logprobs_is_the_same_answer(client, greedy):
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True,
                                       logprobs=2, stream_options={"include_usage": True})
    events = list(stream)
    pieces = [e.choices[0] for e in events if e.choices]
    text = "".join(c.text for c in pieces)
    assert text == greedy(PROMPTS[0], 8)[0]
    assert len([c for c in pieces if c.text]) > 1, "the answer came in one piece"
    assert [c.finish_reason for c in pieces if c.finish_reason] in (["stop"], ["length"])
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == len(
        [t for c in pieces if c.logprobs for t in c.logprobs.tokens])
    tokens = [t for c in pieces if c.logprobs for t in c.logprobs.tokens]
    logprobs = [x for c in pieces if c.logprobs for x in c.logprobs.token_logprobs]
    top = [d for c in pieces if c.logprobs for d in c.logprobs.top_logprobs]
    offsets = [o for c in pieces if c.logprobs for o in c.logprobs.text_offset]
    assert "".join(tokens).strip() == text.strip() and len(logprobs) == len(top) == len(offsets) == len(tokens)
    for token, lp, alternatives in zip(tokens, logprobs, top):
        assert lp <= 0 and math.isfinite(lp) and token in alternatives and len(alternatives) <= 3
        assert max(alternatives.values()) <= lp + 1e-4  # greedy: the chosen token is the most likely
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_bad_fields_are_400s(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"frobnicate": 1})
    assert err.value.body["code"] == "unknown_parameter" and err.value.body["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, suffix="y")
    assert err.value.body["param"] == "suffix"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1500)  # over the pipeline's context of 1024
    assert err.value.body["param"] == "max_tokens" and "1500" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5000)  # over the gateway's context
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:  # streams counts the raw text against its budget
        client.completions.create(model=MODEL, prompt="word " * 1100, max_tokens=8)
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "prompt"


def test_a_completion_reaches_the_worker_raw_and_is_never_recalled(client, pipeline):
    """What streams hands the worker (tapped on the topic): the text itself, no messages, nothing
    recalled. The answer is recorded as a turn (chat.turns; memory is upserted before a turn is
    emitted) yet a chat of the same identified user recalls nothing of it."""
    from chatpipe.testing.streams import Tap
    from schemas.records import ConversationTurn, InferenceRequest

    user, text = f"cmp-{uuid.uuid4().hex[:8]}", "My parrot is called Zorblax."
    tap = Tap(pipeline.kafka, "chat.inference.requests", "chat.turns")
    try:
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=text, max_tokens=4, temperature=0,
                                                          user=user)
        rid = raw.headers["X-Chatpipe-Request-Id"]
        (request,) = tap.records(1, 120, lambda x: isinstance(x, InferenceRequest) and x.request_id == rid)
        assert (request.raw_prompt, request.messages, request.recalled_turn_ids) == (text, [], [])
        (turn,) = tap.records(1, 120, lambda x: isinstance(x, ConversationTurn) and x.request_id == rid)
        assert turn.prompt == text and turn.system_prompt is None and turn.answer == raw.parse().choices[0].text
        chat = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "What is my parrot called?"}], max_tokens=2,
            temperature=0, user=user)
        cid = chat.headers["X-Chatpipe-Request-Id"]
        (asked,) = tap.records(1, 120, lambda x: isinstance(x, InferenceRequest) and x.request_id == cid)
        assert asked.recalled_turn_ids == [] and not any("Zorblax" in m.content for m in asked.messages)
    finally:
        tap.consumer.close()
