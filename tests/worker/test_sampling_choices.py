"""Issue 23 on the worker: the sampling fields of InferenceRequest v3 reach the engine; logprobs
arrive on the chunks (one per token, with the token's real bytes); n = 2 streams two choices and
the request is committed after both; a json_schema answer parses as JSON; a response_format the
worker cannot compile is answered invalid_request with a dead letter. Issue 43: the prompt tokens the
engine's prefix cache held reach the final chunk and the Response (``cached_tokens``), per choice.

The broker tests run one real worker process (the real default model, CPU) on the real broker.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace

import pytest
from confluent_kafka import Consumer, TopicPartition

from chatpipe.testing.worker import ENGINES, REPLIES, Reader, make_request, send_requests, start_worker
from inference.worker.prompts import prepare
from schemas.records import ChatMessage, FinishReason, InferenceRequest, SamplingParams
from formats.response_format import TOOL_CALL_BEGIN, TOOL_CALL_END
from schemas.requests import TOOL_CALLS_FORMAT, response_format_text

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
# KV block size: EngineSettings.kv_block_size (16); vLLM's CPU attention rounds it up to a multiple of 32
BLOCK_TOKENS = {"chatpipe": 16, "vllm": 32}
WEATHER_TOOL = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                      "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from inference.engine.settings import EngineSettings

    return AutoTokenizer.from_pretrained(EngineSettings().default_model_dir(), local_files_only=True)


def request(**sampling) -> InferenceRequest:
    return InferenceRequest(request_id="r", conversation_id="c", user_id="u", tenant="t", created_at=0, model="m",
                            messages=[ChatMessage("user", "hi")], sampling=SamplingParams(**sampling))


@pytest.mark.model
def test_the_sampling_fields_map_onto_the_engine(tokenizer):
    p = prepare(request(presence_penalty=0.5, frequency_penalty=-1.0, logprobs=True, top_logprobs=3, n=2,
                        response_format=response_format_text(JSON_SCHEMA)), tokenizer, 2048)
    assert (p.params.presence_penalty, p.params.frequency_penalty, p.params.logprobs) == (0.5, -1.0, 3)
    assert (p.n, p.response_format, p.logprobs) == (2, JSON_SCHEMA, True)
    assert prepare(request(logprobs=True), tokenizer, 2048).params.logprobs == 0  # the chosen token's only
    plain = prepare(request(), tokenizer, 2048)
    assert (plain.params.logprobs, plain.n, plain.response_format, plain.logprobs) == (None, 1, None, False)


@pytest.mark.model
def test_token_bytes_are_the_real_bytes_of_partial_characters(tokenizer):
    from inference.worker.token_bytes import TokenBytes

    tb = TokenBytes(tokenizer)
    text = 'héllo 😀 {"a": 1}\n\tü — naïve 日本語'
    ids = tokenizer.encode(text)
    assert b"".join(tb.of(i)[1] for i in ids).decode("utf-8") == text
    assert any("\ufffd" in tb.of(i)[0] for i in ids)  # the emoji is split across tokens
    assert tb.of(tokenizer.convert_tokens_to_ids("<|im_end|>")) == ("<|im_end|>", b"<|im_end|>")
    whole = [i for i in range(100, 5000) if "\ufffd" not in tokenizer.decode([i])]
    assert all(tb.of(i)[0] == tokenizer.decode([i]) for i in whole)


# -- on the real broker ----------------------------------------------------------------------------

GROUP = "workers"


@pytest.fixture(scope="module", params=ENGINES)
def service(kafka_stack, tmp_path_factory, request):
    from transport.admin import TopicAdmin
    from transport.settings import KafkaSettings

    kafka = KafkaSettings(bootstrap_servers=kafka_stack.bootstrap_servers, topic_prefix=f"n{uuid.uuid4().hex[:8]}.")
    TopicAdmin(kafka).apply()
    worker = start_worker(kafka, tmp_path_factory.mktemp("choices"), worker_id="choices", group_id=GROUP,
                          engine=request.param)
    worker.wait_serving()
    yield kafka, worker
    code = worker.terminate()
    assert code == 0, f"worker exited {code} on SIGTERM:\n{worker.log()[-3000:]}"


@pytest.fixture
def rd(service):
    r = Reader(service[0])
    yield r
    r.close()


def ask(kafka, i: int, *, text: str, max_tokens: int = 12, **sampling) -> InferenceRequest:
    req = make_request(i, max_tokens=max_tokens, text=text, reply_to=kafka.topic(REPLIES), **sampling)
    send_requests(kafka, [req])
    return req


def committed_to_the_end(kafka, timeout_s: float = 30) -> bool:
    """The worker's group has committed every record of chat.inference.requests (lag 0)."""
    topic = kafka.topic("chat.inference.requests")
    consumer = Consumer({**kafka.client_config(), "group.id": f"{kafka.topic_prefix}{GROUP}",
                         "enable.auto.commit": False})  # never subscribes: reads the group's offsets only
    try:
        partitions = list(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        deadline = time.monotonic() + timeout_s
        while True:
            committed = {tp.partition: max(0, tp.offset)
                         for tp in consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=10)}
            ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions}
            if committed == ends:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
    finally:
        consumer.close()


def choice_streams(seen, request_id: str) -> dict[int, list]:
    """choice_index -> its chunks in index order (one attempt: the test's worker never crashes)."""
    out: dict[int, list] = {}
    for chunk, _ in seen.chunks.get(request_id, []):
        out.setdefault(chunk.choice_index, []).append(chunk)
    return {i: sorted(chunks, key=lambda c: c.index) for i, chunks in out.items()}


def finals_of(seen, request_id: str) -> int:
    return sum(1 for c in seen.final_chunks.get(request_id, []))


@pytest.mark.integration
@pytest.mark.model
def test_logprobs_arrive_on_the_chunks_one_per_token(service, rd):
    kafka, _ = service
    req = ask(kafka, 1, text="Name three colours.", logprobs=True, top_logprobs=2)
    rd.wait_for(lambda s: finals_of(s, req.request_id) == 1, 120, "the final chunk")
    (stream,) = choice_streams(rd.seen, req.request_id).values()
    final = stream[-1]
    assert final.is_final and final.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    tokens = [lp for c in stream for lp in (c.logprobs or [])]
    assert all(c.logprobs is not None and len(c.logprobs) == len(c.token_ids) for c in stream)
    assert len(tokens) == final.tokens_out > 0
    for lp in tokens:
        assert lp.logprob <= 0 and len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob
        assert lp.top[0].logprob >= lp.logprob - 1e-4  # greedy: the chosen token is the most likely one
    text = "".join(c.text for c in stream)
    joined = b"".join(lp.bytes for lp in tokens).decode("utf-8", errors="replace")
    assert joined.startswith(text) or text in joined, (text, joined)  # (an end-of-turn token adds its own text)
    total = sum(lp.logprob for lp in tokens)
    assert -50 * len(tokens) < total <= 0


@pytest.mark.integration
@pytest.mark.model
def test_n_2_streams_two_choices_and_commits_once_both_are_answered(service, rd):
    kafka, _ = service
    req = ask(kafka, 2, text="Tell me a very short story.", max_tokens=10, n=2, temperature=1.0, seed=5)
    rd.wait_for(lambda s: finals_of(s, req.request_id) == 2, 180, "both final chunks")
    streams = choice_streams(rd.seen, req.request_id)
    assert sorted(streams) == [0, 1]
    for chunks in streams.values():
        assert [c.index for c in chunks] == list(range(len(chunks)))  # index counts per choice
        assert chunks[-1].is_final and all(not c.is_final for c in chunks[:-1])
        assert chunks[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert all(c.logprobs is None for c in chunks)
    rd.wait_responses([req.request_id], 30)
    rd.wait_for(lambda s: len(s.responses[req.request_id]) == 2, 30, "both Responses")
    responses = {r.choice_index: r for r, _ in rd.seen.responses[req.request_id]}
    assert sorted(responses) == [0, 1]
    for i, chunks in streams.items():
        assert responses[i].text == "".join(c.text for c in chunks)
        assert responses[i].tokens_out == chunks[-1].tokens_out
        assert responses[i].cached_tokens == chunks[-1].cached_tokens  # each choice's own
    # choice 1 started once choice 0 had computed the prompt, from its blocks in the prefix cache
    assert 0 < responses[1].cached_tokens < responses[1].tokens_in
    assert committed_to_the_end(kafka), "the request was not committed after both choices"


@pytest.mark.integration
@pytest.mark.model
def test_a_json_schema_answer_parses_as_json_of_the_schema(service, rd):
    kafka, _ = service
    req = ask(kafka, 3, text="What is the weather like in Rome? Answer in JSON.", max_tokens=48,
              response_format=response_format_text(JSON_SCHEMA))
    rd.wait_for(lambda s: finals_of(s, req.request_id) == 1, 120, "the final chunk")
    (stream,) = choice_streams(rd.seen, req.request_id).values()
    assert stream[-1].finish_reason is FinishReason.STOP, stream[-1]
    answer = json.loads("".join(c.text for c in stream))
    assert set(answer) == {"city", "sunny"} and answer["city"] in ("Paris", "Rome", "Oslo")
    assert isinstance(answer["sunny"], bool)


@pytest.mark.integration
@pytest.mark.model
def test_a_response_format_the_worker_cannot_compile_is_answered_invalid_request(service, rd):
    kafka, _ = service
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "string", "pattern": "(?=a)b"}}}
    req = ask(kafka, 4, text="hi", response_format=response_format_text(bad))
    rd.wait_for(lambda s: finals_of(s, req.request_id) == 1 and any(req.request_id.encode() in (d.value or b"")
                                                                   for d in s.dead_letters), 60, "the refusal")
    (final,) = rd.seen.final_chunks[req.request_id]
    assert final.error_code == "invalid_request" and "response_format" in final.error, final.error
    letter = next(d for d in rd.seen.dead_letters if req.request_id.encode() in (d.value or b""))
    assert letter.error_type == "InvalidRequestError" and "response_format" in letter.error_message
    good = ask(kafka, 5, text="hi", max_tokens=4)  # and the worker goes on
    rd.wait_responses([good.request_id], 60)


@pytest.mark.integration
@pytest.mark.model
def test_a_repeated_prompt_prefix_is_reported_as_cached_tokens(service, rd):
    """A conversation's second turn resends the first turn's prompt (streams' context): the engine takes
    its whole blocks from the prefix cache, and the final chunk and the Response say how many tokens
    (OpenAI's usage.prompt_tokens_details.cached_tokens). A tenant of its own: nothing of another
    test's requests is in its cache (the cache is salted per tenant), so the first turn's is 0."""
    kafka, worker = service
    tenant = f"cache-{uuid.uuid4().hex[:8]}"
    text = "Describe the colour of the sky on a clear summer afternoon, in one short sentence."
    first = ask(kafka, 6, text=text, max_tokens=8, tenant=tenant)
    rd.wait_responses([first.request_id], 120)
    answer = rd.seen.first_response(first.request_id)[0]
    second = replace(make_request(7, conversation=first.conversation_id, max_tokens=4, tenant=tenant,
                                  reply_to=kafka.topic(REPLIES)),
                     messages=[*first.messages, ChatMessage("assistant", answer.text), ChatMessage("user", "Why?")])
    send_requests(kafka, [second])
    rd.wait_responses([second.request_id], 120)
    rd.wait_for(lambda s: finals_of(s, second.request_id) == 1, 30, "the final chunk")
    block = BLOCK_TOKENS[worker.engine]
    for req, cached in ((first, lambda n, tokens_in: n == 0), (second, lambda n, tokens_in: 0 < n < tokens_in)):
        (final,) = rd.seen.final_chunks[req.request_id]
        response = rd.seen.first_response(req.request_id)[0]
        assert final.cached_tokens == response.cached_tokens, (final, response)
        assert response.cached_tokens % block == 0 and cached(response.cached_tokens, response.tokens_in), response
        assert final.schema_version == 4 and response.schema_version == 3
    # at least the first turn's prompt, but its last token, in whole blocks
    first_prompt = rd.seen.first_response(first.request_id)[0].tokens_in
    assert rd.seen.first_response(second.request_id)[0].cached_tokens >= (first_prompt - 1) // block * block


@pytest.mark.integration
@pytest.mark.model
def test_tool_choice_required_answers_a_call_of_the_tool(service, rd):
    """The gateway's tool-call constraint (tool_choice "required"): the answer is one call of the named
    tool, in the Hermes form the gateway parses (gateway/responses.py), with arguments of its schema."""
    kafka, _ = service
    fmt = {"type": TOOL_CALLS_FORMAT, "tool_calls": {"mode": "required", "parallel": False, "tools": [WEATHER_TOOL]}}
    req = ask(kafka, 8, text="What is the weather in Oslo?", max_tokens=96, response_format=json.dumps(fmt))
    rd.wait_for(lambda s: finals_of(s, req.request_id) == 1, 120, "the final chunk")
    (stream,) = choice_streams(rd.seen, req.request_id).values()
    text = "".join(c.text for c in stream)
    assert stream[-1].finish_reason is FinishReason.STOP, (stream[-1], text)
    assert text.startswith(TOOL_CALL_BEGIN) and text.endswith(TOOL_CALL_END), text
    call = json.loads(text[len(TOOL_CALL_BEGIN):-len(TOOL_CALL_END)])
    assert call["name"] == "get_weather" and isinstance(call["arguments"]["city"], str), call


@pytest.mark.integration
@pytest.mark.model
def test_a_tenant_never_hits_another_tenants_cached_prefix(service, rd):
    """The prefix cache is salted per tenant (ours: the block hashes; vLLM's: ``cache_salt``): the
    same prompt from a second tenant computes it again (cached_tokens 0), while the first tenant's
    repeat takes it from the cache."""
    kafka, _ = service
    a, b = f"salt-a-{uuid.uuid4().hex[:6]}", f"salt-b-{uuid.uuid4().hex[:6]}"
    text = "List three colours that a clear evening sky over the sea can have, separated by commas, please."
    first = ask(kafka, 9, text=text, max_tokens=4, tenant=a)
    rd.wait_responses([first.request_id], 120)
    other = ask(kafka, 10, text=text, max_tokens=4, tenant=b)
    again = ask(kafka, 11, text=text, max_tokens=4, tenant=a)
    rd.wait_responses([other.request_id, again.request_id], 120)
    cached = {name: rd.seen.first_response(req.request_id)[0].cached_tokens
              for name, req in (("first", first), ("other tenant", other), ("same tenant", again))}
    assert cached["first"] == 0 and cached["other tenant"] == 0 and cached["same tenant"] > 0, cached
