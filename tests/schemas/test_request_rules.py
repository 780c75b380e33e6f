"""schemas/requests.py: the one definition of a valid request, and the one context size.

Each rule names the field, the limit and what to change; the gateway, streams and the worker
answer a bad request with the same rule; the largest valid request fits the broker's message
size (with its dead letter); streams, the engine and the gateway read one context size.
"""

from __future__ import annotations

import logging

import pytest

from schemas.records import ChatMessage, DeadLetter, InferenceRequest, PromptRequest, SamplingParams
from schemas.requests import (
    LIMITS,
    ROLES,
    ContextSizeError,
    RequestLimits,
    RequestRuleError,
    check_conversation_id,
    check_messages,
    check_metadata,
    check_prompt_request,
    check_sampling,
    check_user,
    context_tokens_from_env,
)

CONTEXT_NAMES = ("CHATPIPE_CONTEXT_TOKENS", "CHATPIPE_STREAMS_CONTEXT_TOKENS", "CHATPIPE_MAX_SEQ_LEN")


def rule_error(call, *args, **kwargs) -> RequestRuleError:
    with pytest.raises(RequestRuleError) as caught:
        call(*args, **kwargs)
    return caught.value


def prompt(messages=None, **fields) -> PromptRequest:
    sampling = fields.pop("sampling", SamplingParams(max_tokens=16))
    return PromptRequest(conversation_id=fields.pop("conversation_id", "c-1"), user_id=fields.pop("user_id", "ada"),
                         tenant=fields.pop("tenant", "acme"), model="m", sampling=sampling,
                         messages=[ChatMessage("user", "hi")] if messages is None else messages, **fields)


# -- each rule: the field, the limit, what to change --------------------------------------------------

@pytest.mark.parametrize("call, field, limit, says", [
    (lambda: check_messages([("user", "x")] * (LIMITS.max_messages + 1)), "messages", LIMITS.max_messages,
     "send fewer"),
    (lambda: check_messages([("user", "x" * (LIMITS.max_message_chars + 1))]), "messages[0].content",
     LIMITS.max_message_chars, "shorten it"),
    (lambda: check_messages([("user", "x" * LIMITS.max_message_chars)] * 3), "messages", LIMITS.max_prompt_chars,
     "shorten the prompt"),
    (lambda: check_sampling(max_tokens=10**9, context_tokens=2048), "max_tokens", 2047, "at most 2047"),
    (lambda: check_sampling(max_tokens=0), "max_tokens", 1, "at least 1"),
    (lambda: check_sampling(temperature=2.5), "temperature", (0, 2), "in that range"),
    (lambda: check_sampling(temperature=float("nan")), "temperature", (0, 2), "in that range"),
    (lambda: check_sampling(top_p=0.0), "top_p", (0, 1), "above 0 and at most 1"),
    (lambda: check_sampling(top_k=-1), "top_k", 0, "positive"),
    (lambda: check_sampling(seed=2**70), "seed", (-(2**63), 2**63 - 1), "64-bit"),
    (lambda: check_sampling(stop=["x"] * 17), "stop", 16, "send fewer"),
    (lambda: check_sampling(stop=["ok", "y" * 300]), "stop[1]", 256, "shorten it"),
    (lambda: check_user("u" * 10_000), "user", 256, "shorter id"),
    (lambda: check_metadata({f"k{i}": "v" for i in range(17)}), "metadata", 16, "send fewer"),
    (lambda: check_metadata({"k" * 65: "v"}), "metadata", 64, "shorter key"),
    (lambda: check_metadata({"note": "v" * 513}), "metadata.note", 512, "shorten it"),
])
def test_each_limit_names_its_field_the_limit_and_what_to_change(call, field, limit, says):
    error = rule_error(call)
    assert error.field == field and error.limit == limit
    assert says in str(error) and str(error).startswith(f"{field} ")


def test_max_tokens_is_named_as_the_client_named_it():
    error = rule_error(check_sampling, max_tokens=5000, context_tokens=1024,
                       max_tokens_field="max_completion_tokens")
    assert error.field == "max_completion_tokens" and "set max_completion_tokens to at most 1023" in str(error)
    check_sampling(max_tokens=1023, context_tokens=1024)  # the largest that leaves the prompt a token


@pytest.mark.parametrize("messages, says", [
    ([], "no messages"),
    ([("robot", "x"), ("user", "y")], "role 'robot'"),
    ([("user", "x"), ("assistant", "y")], "no user message"),
    ([("user", "   ")], "messages[0].content is empty: the user message needs the text"),
])
def test_message_rules(messages, says):
    assert says in str(rule_error(check_messages, messages))


def test_ids_without_control_characters_and_conversation_ids_of_the_gateways_alphabet():
    assert "control characters" in str(rule_error(check_user, "ada\nINFO forged log line"))
    assert "empty" in str(rule_error(check_user, "  "))
    for bad in ("", "has space", "a/b", "x" * 129):
        assert "A-Z a-z 0-9" in str(rule_error(check_conversation_id, bad))
    check_conversation_id("chat-1.a_b:c@d")
    check_user("shop:ada@example.com")


def test_limits_that_could_not_fit_the_broker_are_refused():
    with pytest.raises(ValueError, match="lower max_prompt_chars"):
        RequestLimits(max_prompt_chars=1_000_000)


# -- the largest valid request fits the broker -----------------------------------------------------

def test_the_largest_valid_prompt_and_its_dead_letter_fit_the_brokers_message_size():
    """A 1 MB prompt used to reach the producer and fail as a 500 KafkaException. At the limits,
    with 4-byte characters everywhere, the record and the dead letter wrapping it must fit 1 MiB."""
    from schemas.codec import default_codec

    wide = "\U0001F600"  # 4 bytes in UTF-8
    per_message = LIMITS.max_message_chars
    messages = [ChatMessage("user", wide * per_message) for _ in range(LIMITS.max_prompt_chars // per_message)]
    record = prompt(messages, user_id=wide * LIMITS.max_user_chars, tenant="t" * LIMITS.max_tenant_chars,
                    conversation_id="c" * 128, reply_to="r" * 249,
                    sampling=SamplingParams(max_tokens=16,
                                            stop=[wide * LIMITS.max_stop_chars] * LIMITS.max_stop_strings,
                                            response_format=largest_response_format(wide)))
    check_prompt_request(record)
    codec = default_codec()
    value = codec.encode(record)
    assert len(value) <= LIMITS.worst_case_bytes() < 0.9 * LIMITS.broker_message_bytes
    dead = codec.encode(DeadLetter(source_topic="chat.prompts", key=b"c" * 128, value=value,
                                   error_type="InvalidPromptError", error_message="x" * 2000,
                                   component="streams.intake"))
    assert len(dead) < LIMITS.broker_message_bytes, f"{len(value)} B record, {len(dead)} B dead letter"


def largest_response_format(wide: str) -> str:
    """A response_format JSON text of exactly the limit's characters, nearly all 4-byte ones."""
    head = '{"type":"json_schema","json_schema":{"name":"n","schema":{"description":"'
    tail = '"}}}'
    text = head + wide * (LIMITS.max_response_format_chars - len(head) - len(tail)) + tail
    assert len(text) == LIMITS.max_response_format_chars
    return text


# -- the same rule in every tier -------------------------------------------------------------------

def test_one_definition_of_roles():
    import gateway.openai_api as gateway
    import inference.worker.prompts as worker
    import streams.prompts as streams
    from schemas import requests

    assert streams.ROLES is requests.ROLES and "ROLES" not in vars(worker) and "ROLES" not in vars(gateway)
    assert set(requests.OPENAI_ROLES) == set(ROLES) | {"developer", "tool"}  # tool: rendered as a user turn


@pytest.mark.parametrize("record, says", [
    (prompt(user_id="u" * 10_000), "user_id is 10000 characters"),
    (prompt([ChatMessage("user", "x" * 300_000)]), "messages[0].content is 300000 characters"),
    (prompt(sampling=SamplingParams(max_tokens=10**9)), "max_tokens is 1000000000, more than"),
    (prompt(sampling=SamplingParams(stop=["s"] * 40)), "stop has 40 stop strings"),
    (prompt(conversation_id="bad id"), "conversation_id is 'bad id', not a conversation id"),
])
def test_streams_refuses_records_straight_from_kafka_with_the_rule(record, says):
    from streams.errors import InvalidPromptError
    from streams.prompts import parse_prompt

    with pytest.raises(InvalidPromptError) as caught:
        parse_prompt(record, context_tokens=2048)
    assert says in str(caught.value) and str(caught.value).startswith(f"PromptRequest {record.request_id!r}: ")


def test_streams_without_a_context_size_still_checks_everything_else():
    from streams.prompts import parse_prompt

    parsed = parse_prompt(prompt(sampling=SamplingParams(max_tokens=10**6)))
    assert parsed.prompt == "hi"


def test_the_worker_refuses_with_the_same_rules():
    from inference.worker.errors import InvalidRequestError, InvalidSamplingError
    from inference.worker.prompts import prompt_ids, sampling_params

    def request(messages=None, **sampling):
        return InferenceRequest(request_id="r", conversation_id="c", user_id="u", tenant="t", created_at=0,
                                model="m", messages=messages or [ChatMessage("user", "hi")],
                                sampling=SamplingParams(**sampling))

    for sampling, says in ((dict(stop=["s"] * 17), "stop has 17 stop strings"), (dict(temperature=3.0), "temperature"),
                           (dict(max_tokens=0), "max_tokens"), (dict(seed=2**64), "seed")):
        with pytest.raises(InvalidSamplingError, match=says):
            sampling_params(request(**sampling))
    with pytest.raises(InvalidRequestError, match=r"messages\[0\].role is unknown: message 0 has role 'developer'"):
        prompt_ids(request([ChatMessage("developer", "x"), ChatMessage("user", "y")]), tokenizer=None)


def test_the_gateway_answers_each_rule_as_a_400_with_its_param():
    from gateway.openai_api import ChatCompletionRequest, OpenAIError

    def body(**fields):
        return ChatCompletionRequest(model="m", **{"messages": [{"role": "user", "content": "hi"}], **fields})

    cases = [
        (body(messages=[{"role": "user", "content": "x" * 1_000_000}]), "messages[0].content"),
        (body(max_tokens=10**9), "max_tokens"),
        (body(max_completion_tokens=4096), "max_completion_tokens"),
        (body(user="u" * 10_000), "user"),
        (body(stop=["s"] * 17), "stop"),
        (body(messages=[{"role": "user", "content": "x"}] * 300), "messages"),
        (body(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
        (body(temperature=5), "temperature"),
        (body(metadata={"conversation_id": "no spaces please"}), "metadata.conversation_id"),
    ]
    for request, param in cases:
        with pytest.raises(OpenAIError) as caught:
            request.check(context_tokens=2048)
        assert (caught.value.status, caught.value.param) == (400, param), caught.value.message
    body(messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
         max_tokens=2047, user="ada", stop=["\n"] * 16).check(context_tokens=2048)


# -- one context size ------------------------------------------------------------------------------

@pytest.fixture
def env(monkeypatch):
    for name in CONTEXT_NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def sizes() -> tuple[int, int, int]:
    from inference.engine.settings import EngineSettings
    from gateway.settings import GatewaySettings
    from streams.settings import StreamsSettings

    return StreamsSettings().context_tokens, EngineSettings().max_seq_len, GatewaySettings().context_tokens


def test_streams_the_engine_and_the_gateway_read_one_context_size(env):
    assert sizes() == (2048, 2048, 2048)
    env.setenv("CHATPIPE_CONTEXT_TOKENS", "1024")
    assert sizes() == (1024, 1024, 1024)


@pytest.mark.parametrize("old", ["CHATPIPE_STREAMS_CONTEXT_TOKENS", "CHATPIPE_MAX_SEQ_LEN"])
def test_the_old_names_still_work_for_every_tier_with_a_warning(env, old, caplog):
    """Set for one tier only (as deployments did), the old name now sizes all three alike."""
    import schemas.requests

    env.setattr(schemas.requests, "_warned", set())
    env.setenv(old, "512")
    with caplog.at_level(logging.WARNING, logger="schemas.requests"):
        assert sizes() == (512, 512, 512)
    assert f"{old} is deprecated: set CHATPIPE_CONTEXT_TOKENS=512" in caplog.text


def test_names_that_disagree_stop_every_tier_from_starting(env):
    """The failure this replaces: streams assembling 2048-token prompts for a worker of 1024."""
    from inference.engine.settings import EngineSettings
    from streams.settings import StreamsSettings

    env.setenv("CHATPIPE_STREAMS_CONTEXT_TOKENS", "2048")
    env.setenv("CHATPIPE_MAX_SEQ_LEN", "1024")
    for settings in (StreamsSettings, EngineSettings):
        with pytest.raises(ContextSizeError, match="CHATPIPE_STREAMS_CONTEXT_TOKENS=2048, CHATPIPE_MAX_SEQ_LEN=1024"):
            settings()
    env.setenv("CHATPIPE_CONTEXT_TOKENS", "1024")
    env.setenv("CHATPIPE_STREAMS_CONTEXT_TOKENS", "1024")
    assert sizes() == (1024, 1024, 1024)  # all three names, one value: fine


def test_bad_values_and_explicit_arguments(env):
    from inference.engine.settings import EngineSettings
    from gateway.settings import GatewaySettings

    assert context_tokens_from_env({}) is None
    with pytest.raises(ContextSizeError, match="not a number of tokens"):
        context_tokens_from_env({"CHATPIPE_CONTEXT_TOKENS": "2k"})
    with pytest.raises(ContextSizeError, match="fewer than 16"):
        context_tokens_from_env({"CHATPIPE_CONTEXT_TOKENS": "8"})
    env.setenv("CHATPIPE_CONTEXT_TOKENS", "1024")
    assert EngineSettings(max_seq_len=64).max_seq_len == 64  # an explicit argument wins, for that process
    with pytest.raises(ValueError, match="CHATPIPE_GATEWAY_DEFAULT_MAX_TOKENS to at most 127"):
        GatewaySettings(context_tokens=128)
