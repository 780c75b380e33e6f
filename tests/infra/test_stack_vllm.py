"""`chatpipe up --engine vllm`: the whole stack with vLLM's engine in the inference worker (its own
environment, infra/vllm_env.py, made by `make test`'s prerequisites), answering the official ``openai``
client through the gateway: a streamed answer, a json_schema answer, a required tool call, and the
README's demo, whose last turn recalls turn 1's fact from the streams tier's memory (as with our engine:
the two engines' greedy tokens are equal, tests/engine/test_vllm_engine.py).

Guards against: `--engine` not reaching the worker, a worker that re-executes itself into the vLLM
environment losing its flags or its code, and a vLLM worker that serves the worker tests' records but not
the gateway's requests (structured outputs, tools, memory's context).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import openai
import pytest
from pydantic import BaseModel, ConfigDict

from chatpipe.testing.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.model]

MODEL = "smollm2-135m-instruct"
# small enough for the broker, streams, the vLLM worker and the gateway on 2 shared cores
ENGINE_ENV = {"CHATPIPE_MAX_BATCH": "4", "CHATPIPE_KV_CACHE_TOKENS": "8192", "CHATPIPE_DEVICE": "cpu",
              "CHATPIPE_NUM_THREADS": "1"}


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str
    country: str


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "220", **ENGINE_ENV}
    return subprocess.run([sys.executable, "-m", "chatpipe.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    state = tmp_path_factory.mktemp("vllm-stack") / "state"
    port = free_port()
    flags = ["--state-dir", str(state), "--kafka-port", str(free_port()), "--controller-port", str(free_port()),
             "--gateway-port", str(port), "--worker-metrics-port", str(free_port()),
             "--streams-metrics-port", str(free_port()), "--redis-port", str(free_port()), "--no-response-cache"]
    try:
        up = _cli("up", *flags, "--engine", "vllm", timeout=900)
        assert up.returncode == 0, up.stdout + up.stderr
        key = next(iter(json.loads((state / "gateway" / "keys.json").read_text())))
        yield state, f"http://127.0.0.1:{port}", key
    finally:
        down = _cli("down", "--state-dir", str(state), timeout=300)
        print(down.stdout + down.stderr)


@pytest.fixture(scope="module")
def client(stack):
    _, url, key = stack
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)


def test_the_worker_runs_vllms_engine(stack):
    state, _, _ = stack
    log = (state / "logs" / "inference.log").read_text()
    assert "engine: vllm" in log, log[-3000:]
    assert json.loads((state / "stack.json").read_text())["settings"]["inference_engine"] == "vllm"


def test_a_streamed_answer(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                            max_tokens=16, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([p for p in pieces if p]) > 1 and "".join(pieces).strip(), pieces


def test_a_json_schema_answer(client):
    answer = client.beta.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        response_format=City, max_tokens=64, temperature=0)
    parsed = answer.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.city, answer


def test_a_required_tool_call(client):
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                       "additionalProperties": False}}}
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather like in Paris right now?"}],
        # one call: vLLM does not close the output before max_tokens as ours does, so a greedy small model
        # that may chain calls (parallel) would chain them until max_tokens
        tools=[tool], tool_choice="required", parallel_tool_calls=False, max_tokens=96, temperature=0).choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.tool_calls, answer
    call = answer.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"], call


def test_the_demo_recalls_turn_ones_fact_from_memory(stack):
    state, url, _ = stack
    done = _cli("demo", "--url", url, "--state-dir", str(state), "--wait-s", "60", timeout=600)
    print(done.stdout)
    assert done.returncode == 0 and "recall: turn 4" in done.stdout, done.stdout + done.stderr
