"""The official ``openai`` client against the gateway, through the real pipeline (no mocks).

Guards: the gateway speaks OpenAI's API as the official client parses it (SSE chunks, usage,
[DONE]); errors come in OpenAI's shape with the status the client maps to its exception types.
"""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from chatpipe.testing.gateway import API_KEY

pytestmark = [pytest.mark.integration, pytest.mark.model]
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def client(pipeline):
    return openai.OpenAI(base_url=f"{pipeline.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def test_streamed_answer_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three colours."}], stream=True, max_tokens=16,
        temperature=0, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text.strip(), "no text streamed"
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1, "the answer came in one piece"
    assert finish in (["stop"], ["length"])
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.prompt_tokens > 5 and 0 < usage.completion_tokens <= 16
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_plain_answer_with_usage(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Answer briefly."},
                               {"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12, temperature=0)
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content.strip()
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.completion_tokens > 0 and answer.usage.prompt_tokens > 5


def test_flex_runs_in_the_batch_class_and_each_answer_names_its_tier(client):
    """Guards against service_tier flex refused or served as interactive, and against an answer that does not
    say the tier that served it (OpenAI's clients read ``service_tier`` off the response and chunks)."""
    flex = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=4, temperature=0, service_tier="flex")
    assert flex.service_tier == "flex" and flex.choices[0].message.content is not None
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=4, temperature=0, service_tier="priority", stream=True)
    assert {c.service_tier for c in stream} == {"default"}  # no class above interactive: served as default


def test_a_conversations_next_turn_reports_its_cached_prompt_tokens(client):
    """Issue 43, OpenAI's ``usage.prompt_tokens_details.cached_tokens`` end to end: the second turn's
    prompt starts with the first turn's (streams puts the history before the new message, the
    conversation goes to the same worker), so the engine takes those blocks from its prefix cache and
    the answer says so; the first turn's is present too (a number, 0 or more: the chat template's
    system prompt may already be cached). Guards against the count lost between the engine, the
    worker's final chunk and the gateway's usage (streamed or not)."""
    conversation = {"X-Chatpipe-Conversation-Id": f"cached-{uuid.uuid4().hex[:12]}"}
    first = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a large animal that lives in the sea."}],
        max_tokens=8, temperature=0, extra_headers=conversation)
    cached_first = first.usage.prompt_tokens_details.cached_tokens
    assert isinstance(cached_first, int) and 0 <= cached_first < first.usage.prompt_tokens
    second = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "How big does it grow?"}], max_tokens=8, temperature=0,
        extra_headers=conversation)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the history came with it
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens > cached_first
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "And what does it eat?"}], max_tokens=4, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_headers=conversation)
    usage = list(stream)[-1].usage
    assert usage is not None and 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def test_models_lists_the_default_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_unknown_model_is_a_404_in_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "model_not_found" and "gpt-17" in err.value.body["message"]


def test_bad_and_missing_key_are_401(pipeline):
    bad = openai.OpenAI(base_url=f"{pipeline.url}/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "invalid_api_key"
    r = httpx.post(f"{pipeline.url}/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_empty_messages_is_a_400_in_openai_shape(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[])
    assert err.value.body["param"] == "messages" and "empty" in err.value.body["message"]


def test_malformed_bodies_get_openai_errors(pipeline):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for body in ({"model": MODEL}, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
                 {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 9},
                 {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}):
        r = httpx.post(f"{pipeline.url}/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(f"{pipeline.url}/v1/chat/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_prompt_over_the_context_gets_context_length_exceeded(client):
    long = "Tell me about the sea. " * 400  # ~2.4k tokens, over the 1024-token context
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}], stream=True)
    assert err.value.body["code"] == "context_length_exceeded"
    assert "token" in err.value.body["message"]


def test_health_and_metrics_need_no_key_and_count_requests(client, pipeline):
    """Orchestrators probe /healthz and scrape /metrics without a key; the counters must move."""
    health = httpx.get(f"{pipeline.url}/healthz").json()
    assert health["status"] == "ok" and health["reply_topic"].endswith(f"chat.replies.{health['gateway_id']}")
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    text = httpx.get(f"{pipeline.url}/metrics").text
    ok = [line for line in text.splitlines() if line.startswith('chatpipe_gateway_requests_total{outcome="ok"}')]
    assert ok and float(ok[0].split()[-1]) >= 1
    assert "chatpipe_gateway_ttft_seconds_count" in text


def test_text_that_cannot_be_encoded_is_a_400_and_frees_its_slot(pipeline):
    """A lone surrogate is valid JSON but no Avro string: the request gets OpenAI's 400 and its backlog
    slot is released (a slot kept forever would, after max_pending such requests, lock everyone out)."""
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "bad \\ud800 text"}]}' % MODEL).encode()
    for _ in range(3):
        r = httpx.post(f"{pipeline.url}/v1/chat/completions", content=body,
                       headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages"
    assert httpx.get(f"{pipeline.url}/healthz").json()["pending"] == 0
