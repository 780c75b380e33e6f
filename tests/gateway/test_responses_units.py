"""The Responses API's translation to chat completions and back (gateway/responses_items.py): input items as
chat messages, tools, tool choice and text.format in chat's words, output items and events."""

from __future__ import annotations

import json

import pytest

from gateway.openai_api import ChatCompletionRequest, OpenAIError
from gateway.responses_items import (ResponsesRequest, chat_body, event, input_messages, output_items,
                                     output_messages)
from transport.response_store import merge
from schemas.records import StoredResponse


def test_input_items_become_chat_messages():
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    items = [{"role": "developer", "content": "be brief"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                              {"type": "input_text", "text": "b"}]},
             {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": '{"x": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": {"ok": True}},
             {"type": "reasoning", "summary": []}]
    assert input_messages(items) == [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"ok": true}'}]


@pytest.mark.parametrize("item, param", [
    ({"role": "tool", "content": "x"}, "input[0].role"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}, "input[0].content[0].type"),
    ({"type": "item_reference", "id": "msg_1"}, "input[0].type"),
])
def test_what_is_not_served_here_is_a_400_naming_it(item, param):
    with pytest.raises(OpenAIError) as caught:
        input_messages([item])
    assert caught.value.status == 400 and caught.value.param == param


def test_a_request_becomes_a_chat_request_with_its_chain_first():
    request = ResponsesRequest(model="m", input="next", instructions="sys", max_output_tokens=9, temperature=0.2,
                               tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                               tool_choice={"type": "function", "name": "f"},
                               text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}})
    body = chat_body(request, [{"role": "user", "content": "before"}, {"role": "assistant", "content": "reply"}])
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user"]
    assert (body["max_completion_tokens"], body["temperature"]) == (9, 0.2)
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["response_format"]["json_schema"]["name"] == "n"
    ChatCompletionRequest.model_validate(body)  # what the chat route takes
    with pytest.raises(OpenAIError):
        chat_body(ResponsesRequest(model="m", input="x", tools=[{"type": "web_search"}]), [])


def test_an_answer_becomes_output_items_and_a_chain_message_again():
    calls = [{"id": "call_abc", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    items = output_items("text", calls, "msg_1")
    assert [i["type"] for i in items] == ["message", "function_call"] and items[1]["call_id"] == "call_abc"
    assert output_messages(items) == [{"role": "assistant", "content": "text", "tool_calls": calls}]
    assert output_items(None, calls, "msg_1")[0]["type"] == "function_call"
    assert output_items("", None, "msg_1")[0]["content"][0]["text"] == ""
    sse = event("response.output_text.delta", 3, delta="hi")
    assert sse.startswith("event: response.output_text.delta\n") and json.loads(sse.split("data: ")[1])[
        "sequence_number"] == 3


def stored(status: str, deleted: bool = False) -> StoredResponse:
    return StoredResponse(response_id="resp_1", tenant="t", user_id="u", conversation_id="c", status=status,
                          messages="[]", body="{}", deleted=deleted)


def test_a_cancel_or_a_deletion_is_never_undone_by_a_later_write():
    assert merge(stored("cancelled"), stored("completed")).status == "cancelled"
    assert merge(stored("completed", deleted=True), stored("completed")).deleted
    assert merge(stored("in_progress"), stored("completed")).status == "completed"
