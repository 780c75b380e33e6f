"""Tool calling's pieces without Kafka: the request's validation (400s naming the field), the prompt
the records carry, the constraint, the output parser (whole and streamed), and the grammar with the
default model's tokenizer (the calls it allows and refuses)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.openai_api import ChatCompletionRequest, OpenAIError
from gateway.responses import ToolCallStream, finish_reason
from gateway.tools import parse_tools, render_messages
from gateway.translate import ChatContent, chat_content
from schemas.requests import TOOL_CALLS_FORMAT, RequestRuleError, response_format_of

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
NOOP = {"type": "function", "function": {"name": "noop"}}
USER = [{"role": "user", "content": "weather in Paris?"}]


@dataclass
class ParsedAnswer:
    content: str | None
    tool_calls: list[dict[str, Any]]


def parse_answer(text: str) -> ParsedAnswer:
    """A whole output, fed at once: its content (None when it is only calls) and its calls in OpenAI's shape."""
    stream = ToolCallStream()
    stream.feed(text)
    stream.end()
    return ParsedAnswer(stream.text, [c.openai() for c in stream.calls])


def request(messages=USER, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model=MODEL, messages=messages, **fields)


def content(messages=USER, **fields) -> ChatContent:
    """The record's messages and sampling, every rule checked (``translate.chat_content``)."""
    return chat_content(request(messages, **fields), context_tokens=2048, default_max_tokens=256)


def record_messages(messages=USER, **fields) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in content(messages, **fields).messages]


def response_format_text(**fields) -> str | None:
    return content(**fields).sampling.response_format


def refusal(messages=USER, **fields) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        content(messages, **fields)
    assert caught.value.status == 400
    return caught.value


# -- the request ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, param, says", [
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type", "function tools only"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "missing"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "1-64"),
    ({"tools": [NOOP, NOOP]}, "tools[1].function.name", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters",
     "JSON Schema"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "required"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "get_weather"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice",
     "not supported"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls", "only allowed when tools"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format", "tools"),
    ({"response_format": {"type": TOOL_CALLS_FORMAT, "tool_calls": {}}}, "response_format.type", "json_schema"),
    ({"functions": [{"name": "f"}]}, "functions", "as tools"),
    ({"function_call": {"name": "f"}}, "function_call", "tool_choice"),
])
def test_malformed_tool_fields_are_400s_naming_the_field(fields, param, says):
    error = refusal(**fields)
    assert error.param == param and says in error.message, (error.param, error.message)


def test_a_parameters_schema_the_grammar_cannot_enforce_names_the_tool_and_the_part():
    bad = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": "ten"}}}}}
    error = refusal(tools=[WEATHER, bad])
    assert error.param == "tools[1]" and "'lookup'" in error.message
    assert "tools[1].function.parameters.properties.n.minimum" in error.message, error.message
    not_object = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    assert "tools[0].function.parameters.type" in refusal(tools=[not_object]).message


@pytest.mark.parametrize("messages, param, says", [
    (USER + [{"role": "tool", "content": "x"}], "messages[1].tool_call_id", "required"),
    (USER + [{"role": "assistant", "content": "ok"}, {"role": "tool", "tool_call_id": "call_1", "content": "x"}],
     "messages[2].tool_call_id", "preceding call"),
    ([{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
     "messages[0].tool_calls", "assistant"),
    (USER + [{"role": "function", "name": "f", "content": "x"}], "messages[1].role", "unknown"),
])
def test_tool_messages_must_answer_a_call(messages, param, says):
    error = refusal(messages, tools=[WEATHER])
    assert error.param == param and says in error.message, (error.param, error.message)


def test_valid_tool_requests_pass():
    content(tools=[WEATHER, NOOP])
    content(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    content(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    content(tools=[WEATHER], tool_choice="none", response_format={"type": "json_object"})
    content(tools=[], tool_choice="none")
    content(HISTORY, tools=[WEATHER])
    # With a conversation id the call is in the stored history: the new message is the result alone.
    content([{"role": "tool", "tool_call_id": "call_a", "content": "18 C"}], tools=[WEATHER])


HISTORY = USER + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city":"Paris","unit":"c"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city":"Lyon","unit":"c"}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": '{"t": 18}'},
    {"role": "tool", "tool_call_id": "call_b", "content": '{"t": 20}'},
]


def test_the_records_carry_tools_calls_and_results_as_text():
    messages = record_messages(HISTORY, tools=[WEATHER])
    assert [role for role, _ in messages] == ["system", "user", "assistant", "user"]
    system = messages[0][1]
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in system
    assert "<tool_call>" in system
    assert messages[2][1] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
                              '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", '
                              '"unit": "c"}}\n</tool_call>')
    assert messages[3][1] == '<tool_response>\n{"t": 18}\n</tool_response>\n<tool_response>\n{"t": 20}\n</tool_response>'
    # The client's system message keeps its text, the tools after it; tool_choice none shows no tools.
    given = render_messages([("developer", "Be brief.", None), ("user", "hi", None)],
                            parse_tools([WEATHER], "auto", None))
    assert given[0][0] == "system" and given[0][1].startswith("Be brief.\n\n# Tools")
    assert record_messages(tools=[WEATHER], tool_choice="none") == [("user", "weather in Paris?")]


def test_the_constraint_rides_in_response_format():
    fmt = json.loads(response_format_text(tools=[WEATHER, NOOP], tool_choice={"type": "function", "function": {
        "name": "get_weather"}}, parallel_tool_calls=False))
    assert fmt == {"type": TOOL_CALLS_FORMAT, "tool_calls": {"mode": "required", "parallel": False, "tools": [
        {"name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]}}
    assert response_format_of(json.dumps(fmt))["type"] == TOOL_CALLS_FORMAT  # what streams and the worker check
    auto = json.loads(response_format_text(tools=[WEATHER, NOOP]))["tool_calls"]
    assert auto["mode"] == "auto" and auto["parallel"] is True and [t["name"] for t in auto["tools"]] == \
        ["get_weather", "noop"]
    assert response_format_text(tools=[WEATHER], tool_choice="none") is None
    with pytest.raises(RequestRuleError):
        response_format_of({"type": TOOL_CALLS_FORMAT, "tool_calls": {"mode": "sometimes", "tools": []}})


# -- the answer -------------------------------------------------------------------------------------

CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "P}a\\"ris", "unit": "c"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')


def test_calls_parse_into_openai_tool_calls():
    parsed = parse_answer(CALLS)
    assert parsed.content is None
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] \
        == [("function", "get_weather", {"city": 'P}a"ris', "unit": "c"}), ("function", "noop", {})]
    ids = [c["id"] for c in parsed.tool_calls]
    assert all(i.startswith("call_") and len(i) == 29 for i in ids) and len(set(ids)) == 2
    text = parse_answer("  Let me check.\n" + CALLS)
    assert text.content == "Let me check." and len(text.tool_calls) == 2
    plain = parse_answer("Hello <b>there</b>, a < b and <tool_ca")
    assert plain.content == "Hello <b>there</b>, a < b and <tool_ca" and plain.tool_calls == []
    cut = parse_answer('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert cut.tool_calls[0]["function"]["arguments"] == '{"city": "Par'


def test_finish_reason_is_tool_calls_after_complete_calls_only():
    done, cut, text = ToolCallStream(), ToolCallStream(), ToolCallStream()
    done.feed(CALLS)
    cut.feed(CALLS[:60])
    text.feed("hi")
    assert finish_reason(done, "stop") == "tool_calls"
    assert finish_reason(cut, "length") == "length" and finish_reason(text, "stop") == "stop"


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_deltas_reassemble_to_the_whole_answer(size):
    answer = "Sure: " + CALLS
    stream, deltas = ToolCallStream(), []
    for i in range(0, len(answer), size):
        deltas += stream.feed(answer[i:i + size])
    deltas += stream.end()
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for piece in d.get("tool_calls", ()):
            if "id" in piece:
                assert piece["index"] not in calls and piece["type"] == "function"
                assert piece["function"]["arguments"] == ""
                calls[piece["index"]] = {"id": piece["id"], "name": piece["function"]["name"], "arguments": ""}
            else:
                assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
                calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
    whole = parse_answer(answer)
    assert content == whole.content == "Sure:"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]
    if size == 1:  # arguments stream as they come, not at the call's end
        assert sum(1 for d in deltas if "tool_calls" in d) > 10


# -- the grammar, with the default model's tokenizer ------------------------------------------------

def _model_dir() -> Path | None:
    path = Path(os.environ.get("CHATPIPE_HOME", Path.home() / ".cache" / "chatpipe")) / "models" / MODEL
    return path if (path / "tokenizer.json").exists() else None


@pytest.fixture(scope="module")
def compiled():
    if _model_dir() is None:
        pytest.skip("the default model is not pulled (chatpipe model pull)")
    from transformers import AutoTokenizer

    from inference.engine.grammar import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(str(_model_dir()))
    return tokenizer, GrammarCompiler(tokenizer, len(tokenizer))


def accepts(compiled, fmt, text, stop=True) -> bool:
    tokenizer, compiler = compiled
    matcher = compiler.matcher(fmt)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if stop:
        ids.append(compiler.stop_token_ids[0])
    return all(matcher.accept_token(i) for i in ids)


def fmt_of(**fields) -> dict:
    return json.loads(response_format_text(tools=[WEATHER, NOOP], **fields))


def test_required_allows_valid_calls_only(compiled):
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    required = fmt_of(tool_choice="required")
    assert accepts(compiled, required, one)
    assert accepts(compiled, required, one + '\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
    assert not accepts(compiled, required, "Hello")  # text is not a call
    assert not accepts(compiled, required, one.replace('"c"', '"k"'))  # enum
    assert not accepts(compiled, required, one.replace("get_weather", "get_wether"))  # not a tool
    assert not accepts(compiled, required, one.replace(', "unit": "c"', ""))  # required property
    assert not accepts(compiled, required, one[:40], stop=True)  # no stop inside a call
    named = fmt_of(tool_choice={"type": "function", "function": {"name": "noop"}})
    assert not accepts(compiled, named, one) and accepts(compiled, named, '<tool_call>\n{"name": "noop", '
                                                                          '"arguments": {}}\n</tool_call>')


def test_parallel_tool_calls_false_allows_one_call(compiled):
    one = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    single = fmt_of(tool_choice="required", parallel_tool_calls=False)
    assert accepts(compiled, single, one) and not accepts(compiled, single, one + "\n" + one)
    parallel = fmt_of(tool_choice="required")
    assert accepts(compiled, parallel, "\n".join([one] * 4)) and not accepts(compiled, parallel, "\n".join([one] * 5))


def test_auto_allows_text_and_constrains_a_started_call(compiled):
    auto = fmt_of()
    assert accepts(compiled, auto, "Just text, no call.")
    assert accepts(compiled, auto, 'Checking. <tool_call>\n{"name": "get_weather", "arguments": '
                                   '{"city": "Oslo", "unit": "f"}}\n</tool_call>')
    assert not accepts(compiled, auto, '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Oslo"}}',
                       stop=False)
    assert not accepts(compiled, auto, '<tool_call>\n{"name": "rm_rf", ', stop=False)


def test_a_required_call_closes_before_max_tokens(compiled):
    """The budgeted matcher ends a call as valid JSON even when the model would ramble on."""
    import xgrammar

    tokenizer, compiler = compiled
    matcher = compiler.matcher(fmt_of(tool_choice="required", parallel_tool_calls=False), max_tokens=60)
    mask = xgrammar.allocate_token_bitmask(1, compiler.vocab_size)  # all tokens allowed, one row
    x_id = tokenizer.encode("x", add_special_tokens=False)[0]
    out = []
    for _ in range(60):
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(mask)
        allowed = [i for i in range(compiler.vocab_size) if (int(mask[0, i >> 5]) >> (i & 31)) & 1]
        # a rambling model: "x" whenever it may, else the longest allowed token
        pick = x_id if x_id in allowed else max(allowed, key=lambda i: len(tokenizer.decode([i])))
        assert matcher.accept_token(pick)
        out.append(pick)
    assert matcher.is_terminated(), tokenizer.decode(out)
    text = tokenizer.decode([i for i in out if i not in compiler.stop_token_ids])
    parsed = parse_answer(text)
    assert len(parsed.tool_calls) == 1, text
    json.loads(parsed.tool_calls[0]["function"]["arguments"])
