"""OpenAI's Responses API through the real pipeline, with a second gateway replica beside the package's:
the official ``openai`` client and the OpenAI Agents SDK (``openai-agents``, its default Responses model)
against both. A stored response is read and continued (``previous_response_id``) by the other replica,
its context the chain's messages; streamed events parse in the official client and add up to the final
response; background + poll + cancel; DELETE, ``store: false`` and another tenant's id are 404; function
tools and ``text.format``; an erasure of the user deletes their stored responses."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from chatpipe.testing.gateway import API_KEY, OTHER_TENANT_KEY, start_gateway
from chatpipe.testing.streams import Tap
from schemas.codec import default_codec

pytestmark = [pytest.mark.integration, pytest.mark.model]
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def replica(pipeline, tmp_path_factory):
    """A second gateway on the package pipeline's topics (its own keys file, the same keys)."""
    gateway = start_gateway(pipeline.kafka, tmp_path_factory.mktemp("responses-b"))
    try:
        gateway.wait_healthy(90)
        yield gateway
    finally:
        assert gateway.terminate() == 0, gateway.log()[-3000:]


def client(url: str, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def inference_request_of(pipeline, request_id: str):
    tap, codec = Tap(pipeline.kafka, "chat.inference.requests"), default_codec()
    try:
        (message,) = tap.messages(1, timeout_s=60, where=lambda m: codec.decode(m.value()).request_id == request_id)
        return codec.decode(message.value())
    finally:
        tap.close()


def test_a_stored_response_is_read_and_continued_by_the_other_replica_and_after_a_restart(pipeline, replica, tmp_path):
    a, b = client(pipeline.url), client(replica.url)
    first = a.responses.with_raw_response.create(model=MODEL, input="My cat is called Pixel.", max_output_tokens=8,
                                                 temperature=0, instructions="Answer briefly.")
    one = first.parse()
    assert one.status in ("completed", "incomplete") and one.output_text and one.usage.output_tokens > 0
    assert b.responses.retrieve(one.id).output_text == one.output_text  # the state is the pipeline's
    second = b.responses.with_raw_response.create(model=MODEL, input="What is my cat called?", max_output_tokens=8,
                                                  temperature=0, previous_response_id=one.id)
    two = second.parse()
    assert two.previous_response_id == one.id and two.output_text
    request = inference_request_of(pipeline, second.headers["x-chatpipe-request-id"])
    said = [(m.role, m.content) for m in request.messages]
    assert ("user", "My cat is called Pixel.") in said and ("assistant", one.output_text) in said, said
    assert said[-1] == ("user", "What is my cat called?") and ("system", "Answer briefly.") not in said
    assert first.headers["x-chatpipe-conversation-id"] == second.headers["x-chatpipe-conversation-id"]
    # its span names its route, and the pipeline's hops join its trace (one trace from the HTTP call on)
    from clients.traces import read_span_files, trace_of_request

    deadline = time.monotonic() + 60
    while not [r for r in trace_of_request(read_span_files(pipeline.traces_dir), first.headers[
            "x-chatpipe-request-id"]) if r.name == "POST /v1/responses" and r.service == "gateway"]:
        # the package pipeline's gateway writes its spans under traces_dir (the replica writes none)
        assert time.monotonic() < deadline, "no gateway span POST /v1/responses for the first response"
        time.sleep(0.5)
    # a gateway started after both were stored (a restart: nothing in its memory) serves them from the topic
    fresh = start_gateway(pipeline.kafka, tmp_path)
    try:
        fresh.wait_healthy(90)
        assert client(fresh.url).responses.retrieve(two.id).output_text == two.output_text
    finally:
        assert fresh.terminate() == 0, fresh.log()[-3000:]


def test_streamed_events_parse_in_the_official_client_and_add_up(pipeline):
    c = client(pipeline.url)
    events = list(c.responses.create(model=MODEL, input="Name three colours.", max_output_tokens=12, temperature=0,
                                      stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert kinds.count("response.output_text.delta") > 1 and text == final.output_text and final.usage.output_tokens
    with c.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=6, temperature=0) as stream:
        assert stream.get_final_response().output_text  # the client's own accumulator agrees with the events
    assert c.responses.retrieve(final.id).output_text == text


def test_background_poll_and_cancel(pipeline, replica):
    a, b = client(pipeline.url), client(replica.url)
    done = a.responses.create(model=MODEL, input="Count to five.", max_output_tokens=8, temperature=0, background=True)
    assert done.status == "queued"
    deadline = time.monotonic() + 120
    while (polled := b.responses.retrieve(done.id)).status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.3)
    assert polled.status in ("completed", "incomplete") and polled.output_text
    long = a.responses.create(model=MODEL, input="Write a long story about the sea.", max_output_tokens=400,
                              temperature=0, background=True)
    while b.responses.retrieve(long.id).status == "queued" and time.monotonic() < deadline:
        time.sleep(0.2)
    cancelled = b.responses.cancel(long.id)  # asked of the replica that does not run it
    assert cancelled.status == "cancelled"
    time.sleep(2.0)
    assert a.responses.retrieve(long.id).status == "cancelled"  # the run's end did not overwrite the cancel
    with pytest.raises(openai.ConflictError):
        a.responses.cancel(done.id)


def test_delete_store_false_and_another_tenant_are_404(pipeline, replica):
    a, other = client(pipeline.url), client(replica.url, OTHER_TENANT_KEY)
    kept = a.responses.create(model=MODEL, input="Hi.", max_output_tokens=4, temperature=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=MODEL, input="And?", max_output_tokens=4, previous_response_id=kept.id)
    assert a.responses.delete(kept.id) is None
    with pytest.raises(openai.NotFoundError):
        client(replica.url).responses.retrieve(kept.id)
    unstored = a.responses.create(model=MODEL, input="Hi.", max_output_tokens=4, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError):
        a.responses.create(model=MODEL, input="Hi.", background=True, store=False)


def test_function_tools_and_json_schema(pipeline):
    c = client(pipeline.url)
    weather = {"type": "function", "name": "get_weather", "description": "The weather in a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    called = c.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[weather],
                                tool_choice="required", max_output_tokens=48, temperature=0)
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    answered = c.responses.create(model=MODEL, previous_response_id=called.id, tools=[weather], max_output_tokens=16,
                                  temperature=0, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                         "output": "sunny, 21 C"}])
    assert answered.output_text
    schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"],
              "additionalProperties": False}
    structured = c.responses.create(model=MODEL, input="Give me a colour as JSON.", max_output_tokens=32, temperature=0,
                                    text={"format": {"type": "json_schema", "name": "colour", "schema": schema,
                                                     "strict": True}})
    assert set(json.loads(structured.output_text)) == {"colour"}


def test_an_erasure_of_the_user_deletes_their_stored_responses(pipeline, replica):
    a = client(pipeline.url)
    user = f"erased-{time.time_ns()}"
    mine = a.responses.create(model=MODEL, input="Remember me.", max_output_tokens=4, temperature=0, user=user)
    kept = a.responses.create(model=MODEL, input="Someone else.", max_output_tokens=4, temperature=0,
                              user=f"{user}-other")
    erased = httpx.delete(f"{pipeline.url}/v1/users/{user}", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert erased.status_code == 202, erased.text
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            client(replica.url).responses.retrieve(mine.id)
        except openai.NotFoundError:
            break
        time.sleep(0.3)
    else:
        raise AssertionError("the erased user's stored response is still served")
    assert a.responses.retrieve(kept.id).id == kept.id


def test_the_agents_sdk_runs_two_turns_the_second_on_the_other_replica(pipeline, replica):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # its traces would go to OpenAI's servers

    def model(url: str) -> OpenAIResponsesModel:
        return OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY,
                                                                                  max_retries=0))

    settings = ModelSettings(temperature=0, max_tokens=256)  # room to end: the SDK takes "incomplete" for a failure
    agent = Agent(name="assistant", instructions="Answer in one short sentence.", model=model(pipeline.url),
                  model_settings=settings)

    async def two_turns():
        first = await Runner.run(agent, "My favourite colour is green.")
        second = await Runner.run(agent.clone(model=model(replica.url)), "What is my favourite colour?",
                                  previous_response_id=first.last_response_id)
        return first, second

    first, second = asyncio.run(two_turns())
    assert isinstance(first.final_output, str) and first.final_output
    assert isinstance(second.final_output, str) and second.final_output
    stored = client(replica.url).responses.retrieve(second.last_response_id)
    assert stored.previous_response_id == first.last_response_id
