"""Tool calling with the official ``openai`` client and LangChain's ``ChatOpenAI``, through the real
pipeline (gateway, streams, the inference worker with the default model; no mocks).

Before (issue 23): any request with ``tools`` was a 400 "planned".
"""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from chatpipe.testing.gateway import API_KEY

pytestmark = [pytest.mark.integration, pytest.mark.model]
MODEL = "smollm2-135m-instruct"


class GetWeather(BaseModel):
    """Get the current weather in a city."""
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=40, description="the city, e.g. Paris")
    unit: Literal["celsius", "fahrenheit"]


class GetTime(BaseModel):
    """Get the current local time in a time zone."""
    model_config = ConfigDict(extra="forbid")
    timezone: str = Field(max_length=40, description="an IANA time zone, e.g. Europe/Paris")


TOOLS = [openai.pydantic_function_tool(GetWeather, name="get_weather"),
         openai.pydantic_function_tool(GetTime, name="get_time")]
ARGS = {"get_weather": GetWeather, "get_time": GetTime}
ASK = [{"role": "system", "content": "You are a helpful assistant with tools."},
       {"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def client(pipeline):
    return openai.OpenAI(base_url=f"{pipeline.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def valid_call(call) -> BaseModel:
    assert call.id.startswith("call_") and call.type == "function", call
    assert call.function.name in ARGS, call
    return ARGS[call.function.name].model_validate_json(call.function.arguments)  # the parameters schema


def test_required_tool_call_round_trip(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=96, temperature=0)
    answer = first.choices[0]
    assert answer.finish_reason == "tool_calls", answer
    assert answer.message.content is None and answer.message.tool_calls, answer.message
    calls = answer.message.tool_calls
    for call in calls:
        valid_call(call)
    # The result goes back with the call in the history; the model answers in text.
    history = ASK + [answer.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature_c": 18, "conditions": "sunny"})}
        for c in calls]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=48, temperature=0)
    text = second.choices[0]
    assert text.message.tool_calls is None and text.message.content and text.message.content.strip(), text
    assert text.finish_reason in ("stop", "length")


def test_a_named_function_is_the_one_called(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=96, temperature=0.7, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    assert answer.finish_reason == "tool_calls"
    assert [c.function.name for c in answer.message.tool_calls] == ["get_time"]
    assert isinstance(valid_call(answer.message.tool_calls[0]), GetTime)


def test_parallel_tool_calls_false_gives_one_call(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo and in Lima, and the time in Tokyo?"}],
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=96, temperature=0).choices[0]
    assert answer.finish_reason == "tool_calls" and len(answer.message.tool_calls) == 1
    valid_call(answer.message.tool_calls[0])


def test_streamed_tool_call_deltas_reassemble_to_the_same_call(client):
    asked = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96, temperature=0)
    whole = client.chat.completions.create(**asked).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    with client.chat.completions.create(stream=True, **asked) as stream:
        for event in stream:
            if not event.choices:
                continue
            delta = event.choices[0].delta
            assert not delta.content, delta  # a call only: no text
            for piece in delta.tool_calls or ():
                if piece.index not in calls:  # the first delta of a call: id, type, name
                    assert piece.id.startswith("call_") and piece.type == "function" and piece.function.name
                    calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
                else:
                    assert piece.id is None and not piece.function.name
                calls[piece.index]["arguments"] += piece.function.arguments or ""
            finish = event.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]
    for c in calls.values():
        ARGS[c["name"]].model_validate_json(c["arguments"])


def test_auto_answers_text_or_a_valid_call(client):
    prompts = ["What is the weather like in Paris right now?", "Tell me a short joke about cats.",
               "What time is it in Tokyo?"]
    for i, prompt in enumerate(prompts):
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                tools=TOOLS, max_tokens=64, temperature=0.7, seed=i).choices[0]
        if answer.message.tool_calls:
            assert answer.finish_reason in ("tool_calls", "length")
            if answer.finish_reason == "tool_calls":
                for call in answer.message.tool_calls:
                    valid_call(call)
        else:
            assert answer.message.content and answer.finish_reason in ("stop", "length"), answer


def test_a_parameters_schema_the_grammar_cannot_enforce_is_a_400_naming_the_tool(client):
    bad = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "pattern": "(?=x)y"}}}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[TOOLS[0], bad])
    assert err.value.body["param"] == "tools[1]", err.value.body
    assert "lookup" in err.value.body["message"] and "tools[1].function.parameters.properties.q.pattern" in \
        err.value.body["message"]


def test_langchain_bind_tools_returns_tool_calls(pipeline):
    import langchain_openai  # a test dependency (pyproject test extra): missing, this fails
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{pipeline.url}/v1", api_key=API_KEY, temperature=0,
                                      max_tokens=96, max_retries=0, timeout=300)
    message = llm.bind_tools([GetWeather, GetTime], tool_choice="any").invoke("What's the weather in Lima?")
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call["name"] in ("GetWeather", "GetTime") and call["id"].startswith("call_")
        {"GetWeather": GetWeather, "GetTime": GetTime}[call["name"]].model_validate(call["args"])


class City(BaseModel):
    """A city and its country."""
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)


@pytest.mark.parametrize("method", [None, "function_calling"])
def test_langchain_with_structured_output(pipeline, method):
    """The default method (json_schema in langchain-openai 1.x) and the tools one."""
    import langchain_openai  # a test dependency (pyproject test extra): missing, this fails
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{pipeline.url}/v1", api_key=API_KEY, temperature=0,
                                      max_tokens=96, max_retries=0, timeout=300)
    structured = llm.with_structured_output(City) if method is None else \
        llm.with_structured_output(City, method=method)
    city = structured.invoke("Name a big city in Peru.")
    assert isinstance(city, City) and city.name, city
