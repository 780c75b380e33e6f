"""The raw prompt of PromptRequest v5 / InferenceRequest v3 (POST /v1/completions): it round-trips,
older versions read as a chat request (``raw_prompt`` None), the rules every tier checks, streams'
parse and the worker's tokenization (the text as it is, no chat template).

Guards against: a raw prompt lost on the way (served as an empty chat), a raw prompt that also
carries messages (twice the record size, and which one is served?), a raw prompt put through the
chat template or the system prompt.
"""

from __future__ import annotations

import pytest

from schemas.codec import default_codec
from schemas.records import ChatMessage, InferenceRequest, PromptRequest, SamplingParams
from schemas.requests import LIMITS, RequestRuleError, check_prompt_request
from tests.schemas.test_sampling_records import older

codec = default_codec()


def prompt(raw: str | None = "Once upon a time", messages=None) -> PromptRequest:
    return PromptRequest(conversation_id="c1", user_id="ada", tenant="acme", model="m", raw_prompt=raw,
                         messages=[] if messages is None else messages, sampling=SamplingParams(max_tokens=8))


def inference(raw: str | None = "Once upon a time", messages=None) -> InferenceRequest:
    return InferenceRequest(request_id="r1", conversation_id="c1", user_id="ada", tenant="acme", created_at=1,
                            model="m", messages=[] if messages is None else messages, raw_prompt=raw,
                            sampling=SamplingParams(max_tokens=8))


def test_the_raw_prompt_round_trips_in_both_requests():
    for record in (prompt(), inference()):
        decoded = codec.decode(codec.encode(record))
        assert decoded.raw_prompt == "Once upon a time" and decoded.messages == []
    assert codec.decode(codec.encode(prompt(None, [ChatMessage("user", "hi")]))).raw_prompt is None


@pytest.mark.parametrize("name, record, version", [("PromptRequest", prompt(None, [ChatMessage("user", "hi")]), 4),
                                                   ("InferenceRequest", inference(None, [ChatMessage("user", "hi")]), 2)])
def test_older_versions_read_as_chat_requests(name, record, version):
    decoded = codec.decode(older(record, name, version))
    assert decoded.raw_prompt is None and decoded.messages == [ChatMessage("user", "hi")]


@pytest.mark.parametrize("record, field, says", [
    (prompt(""), "raw_prompt", "empty"),
    (prompt("x" * (LIMITS.max_prompt_chars + 1)), "raw_prompt", "over the limit"),
    (prompt("text", [ChatMessage("user", "hi")]), "messages", "must be empty with raw_prompt"),
    (prompt(None), "messages", "empty"),
])
def test_the_rules_of_a_raw_prompt(record, field, says):
    with pytest.raises(RequestRuleError) as err:
        check_prompt_request(record)
    assert err.value.field == field and says in str(err.value)


def test_a_raw_prompt_within_the_rules_passes():
    check_prompt_request(prompt("  leading spaces and <|im_start|> are the client's own  "))


def test_streams_parses_a_raw_prompt_without_system_or_history():
    from streams.prompts import parse_prompt

    parsed = parse_prompt(prompt("def fib(n):"))
    assert (parsed.prompt, parsed.system_prompt, parsed.history, parsed.raw) == ("def fib(n):", None, [], True)
    assert parse_prompt(prompt(None, [ChatMessage("user", "hi")])).raw is False


def test_a_pending_raw_prompt_is_not_remembered_and_old_states_are():
    from streams.state import ConversationState, PendingRequest

    state = ConversationState("acme", "ada", "c1")
    state.add_pending(PendingRequest("r1", "text", None, 1, remember=False), 8)
    value = state.to_value()
    assert ConversationState.from_value(value).pending[0].remember is False
    del value["pending"][0]["remember"]  # a state written before the field
    assert ConversationState.from_value(value).pending[0].remember is True


class SpyTokenizer:
    """Records how it was asked; a chat template that must not be used."""

    chat_template = "{{ never }}"

    def __init__(self):
        self.calls = []

    def encode(self, text, **kw):
        self.calls.append((text, kw))
        return [ord(c) for c in text]

    def apply_chat_template(self, *_, **__):
        raise AssertionError("a raw prompt went through the chat template")


def test_the_worker_tokenizes_a_raw_prompt_as_it_is():
    from inference.worker.errors import InvalidRequestError, PromptTooLongError
    from inference.worker.prompts import prepare

    tok = SpyTokenizer()
    prepared = prepare(inference("Hi <|x|>"), tok, 64)
    assert prepared.prompt_ids == [ord(c) for c in "Hi <|x|>"]
    assert tok.calls == [("Hi <|x|>", {})]  # as tokenizer(text): the tokenizer's defaults
    with pytest.raises(InvalidRequestError, match="no messages"):
        prepare(inference("Hi", [ChatMessage("user", "hi")]), tok, 64)
    with pytest.raises(InvalidRequestError, match="empty"):
        prepare(inference(""), tok, 64)
    with pytest.raises(PromptTooLongError):
        prepare(inference("x" * 60), tok, 64)  # 60 + max_tokens 8 > 64
