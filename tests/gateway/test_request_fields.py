"""Every field of OpenAI's Chat Completions request: honoured, refused with a 400 naming it, or
ignored for the reason docs/gateway.md ("Request fields") gives, and the table there agreeing with
the code. No Kafka, no model (the app in process: tests/gateway/inprocess.py).

Before (issue 23): ``logprobs``, ``response_format`` and the penalties were taken and silently
dropped, and a field nobody knew (a typo, a vendor's extension) was ignored without a word.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gateway.openai_api import ChatCompletionRequest, OpenAIError
from gateway.translate import chat_content
from schemas.records import PromptRequest
from tests.gateway.inprocess import MODEL, app_client, piece

DOCS = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"

# OpenAI's Chat Completions request (openai-python 3.57's completion_create_params, December 2026).
OPENAI_FIELDS = {
    "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "n", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
    "response_format", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "user",
    "metadata", "store", "service_tier", "modalities", "audio", "prediction", "reasoning_effort",
    "web_search_options", "verbosity", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
    "safety_identifier", "moderation",
}
# Accepted and not acted on (ChatCompletionRequest's comments and the docs' rows say why).
IGNORED = {"prediction", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "safety_identifier"}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}], **fields)


def checked(body: ChatCompletionRequest):
    """Every rule the gateway applies before a record exists: the fields', the tools', the response
    format's (its grammar included), as ``translate.chat_request_to_prompt`` runs them."""
    return chat_content(body, context_tokens=2048, default_max_tokens=256)


def refusal(**fields) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        checked(request(**fields))
    assert caught.value.status == 400
    return caught.value


def docs_table() -> dict[str, str]:
    """field -> its row's status (supported | refused | ignored), from docs/gateway.md."""
    text = DOCS.read_text()
    section = text.split("## Request fields", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `([a-z_]+)` \| (supported|refused|ignored)\b", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def test_the_docs_table_names_every_field_of_openais_request_and_of_the_gateways():
    """A field in neither the table nor the code would be answered in a way nobody wrote down."""
    rows = docs_table()
    model_fields = set(ChatCompletionRequest.model_fields)
    assert OPENAI_FIELDS <= model_fields, OPENAI_FIELDS - model_fields
    assert set(rows) == model_fields, (set(rows) ^ model_fields)
    assert {f for f, status in rows.items() if status == "ignored"} == IGNORED


def test_the_docs_table_status_is_what_the_code_does():
    """Each row marked refused is a 400 naming the field for a value that asks for the feature."""
    asks = {"functions": [{"name": "f"}], "function_call": "auto",
            "logit_bias": {"42": 5}, "store": True, "modalities": ["text", "audio"],
            "audio": {"voice": "alloy", "format": "wav"}, "reasoning_effort": "high", "verbosity": "low",
            "web_search_options": {}, "moderation": {"model": "omni-moderation-latest"}}
    refused = {f for f, status in docs_table().items() if status == "refused"}
    assert refused == set(asks)
    for name, value in asks.items():
        error = refusal(**{name: value})
        assert error.param == name and error.code in ("unsupported_parameter", "unsupported_value"), (name, error)
        assert name in error.message, error.message  # the message names what to drop


@pytest.mark.parametrize("fields", [
    {"tool_choice": "none"}, {"function_call": "none"}, {"tools": []}, {"logit_bias": {}}, {"store": False},
    {"service_tier": "auto"}, {"service_tier": "default"}, {"service_tier": "flex"}, {"service_tier": "priority"},
    {"modalities": ["text"]}, {"reasoning_effort": "none"},
    {"prediction": {"type": "content", "content": "x"}}, {"prompt_cache_key": "k"},
    {"prompt_cache_retention": "24h"}, {"prompt_cache_options": {"mode": "implicit"}}, {"safety_identifier": "u1"},
    {"stream_options": {"include_usage": True, "include_obfuscation": False}},
])
def test_values_that_ask_for_nothing_chatpipe_lacks_are_accepted(fields):
    checked(request(**fields))


@pytest.mark.parametrize("fields, param, says", [
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    ({"top_logprobs": 3}, "top_logprobs", "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"n": 9}, "n", "[1, 8]"),
    ({"n": 0}, "n", "[1, 8]"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
])
def test_new_sampling_fields_out_of_range_are_400s_naming_the_field(fields, param, says):
    error = refusal(**fields)
    assert error.param == param and says in error.message, error.message


def test_a_schema_the_grammar_cannot_compile_is_a_400_naming_the_part():
    bad = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": {
        "type": "object", "properties": {"age": {"type": "integer", "minimum": "ten"}}}}}
    error = refusal(response_format=bad)
    assert error.param == "response_format"
    assert "response_format.json_schema.schema" in error.message, error.message


def test_good_schemas_pass_the_check():
    checked(request(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA,
                                                                             "strict": True}}))
    checked(request(response_format={"type": "json_object"}))
    checked(request(response_format={"type": "text"}))


def test_an_unknown_field_is_a_400_in_openais_words(tmp_path):
    """OpenAI refuses an argument it does not know; a typo ("temprature") must not pass as a default."""
    client = app_client(tmp_path, lambda p: [])
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                  "temprature": 0.2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "temprature" and error["code"] == "unknown_parameter"
    assert error["message"].startswith("Unrecognized request argument supplied: temprature")


def test_the_prompt_request_carries_the_new_sampling_fields(tmp_path):
    """What the gateway accepts must reach the worker: the PromptRequest's sampling has each field."""
    client = app_client(tmp_path, lambda p: [piece(p, i, 0, "{}", final=True, tokens_out=1) for i in range(3)])
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5,
        "frequency_penalty": -0.25, "logprobs": True, "top_logprobs": 3, "n": 3, "seed": 7, "top_k": 40,
        "response_format": fmt})
    assert r.status_code == 200, r.text
    (prompt,) = [record for _, record in client.producer.sent if isinstance(record, PromptRequest)]
    s = prompt.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.logprobs, s.top_logprobs, s.n, s.seed, s.top_k) == \
        (0.5, -0.25, True, 3, 3, 7, 40)
    assert json.loads(s.response_format) == fmt and list(json.loads(s.response_format)["json_schema"]["schema"]
                                                         ["properties"]) == ["name", "age"]  # order kept


def test_defaults_and_free_text_leave_the_sampling_as_before(tmp_path):
    client = app_client(tmp_path, lambda p: [piece(p, 0, 0, "hi", final=True, tokens_out=1)])
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                  "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    (prompt,) = [record for _, record in client.producer.sent if isinstance(record, PromptRequest)]
    s = prompt.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.logprobs, s.top_logprobs, s.n, s.response_format) == \
        (0.0, 0.0, False, 0, 1, None)
