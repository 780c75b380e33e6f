"""POST /v1/completions without Kafka: the request model's rules (unit), and the HTTP shapes the
gateway builds from TokenChunks (the app in process, tests/gateway/inprocess.py), parsed by the
official ``openai`` client. The real pipeline's answer is test_completions.py's.

Guards against: a field silently ignored (suffix, best_of > n, echo with logprobs), OpenAI's
default of 16 max_tokens lost, prompts of a list mixed up (index = prompt * n + choice), the
legacy logprobs object built wrong (top_logprobs without the chosen token, text_offset counting a
split character twice), a PromptRequest that carries messages or a chat template's input.
"""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import ValidationError

from gateway.completions import Offsets, legacy_logprobs
from gateway.openai_api import CompletionRequest, OpenAIError
from gateway.translate import DEFAULT_COMPLETION_MAX_TOKENS, sampling_params
from schemas.records import FinishReason, PromptRequest, TokenLogprob, TopLogprob
from tests.gateway.inprocess import API_KEY, MODEL, app_client, piece, token


def req(**fields) -> CompletionRequest:
    return CompletionRequest(**{"model": MODEL, "prompt": "Once upon a time", **fields})


def sampling(body: CompletionRequest):
    """The record's sampling, as ``translate.completion_request_to_prompts`` makes it."""
    return sampling_params(body, body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, logprobs=body.logprobs is not None,
                           top_logprobs=body.logprobs or 0)


# -- the request model ------------------------------------------------------------------------------

def test_a_string_or_a_list_of_strings():
    assert req().check(1024) == ["Once upon a time"]
    assert req(prompt=["a", "b"]).check(1024) == ["a", "b"]


def test_defaults_are_openai_completions():
    s = sampling(req())
    assert (s.max_tokens, s.n, s.logprobs, s.top_logprobs, s.stop, s.response_format) == (16, 1, False, 0, [], None)
    s = sampling(req(max_tokens=5, temperature=0, top_p=0.5, seed=3, stop="\n", n=2, logprobs=3,
                     presence_penalty=0.5))
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop, s.n, s.logprobs, s.top_logprobs,
            s.presence_penalty) == (5, 0, 0.5, 3, ["\n"], 2, True, 3, 0.5)
    assert sampling(req(logprobs=0)).logprobs is True and sampling(req(logprobs=0)).top_logprobs == 0


@pytest.mark.parametrize("fields, param, says", [
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": ["ok", ""]}, "prompt[1]", "empty"),
    ({"prompt": []}, "prompt", "empty list"),
    ({"prompt": [1, 2, 3]}, "prompt", "token-id"),
    ({"prompt": [[1, 2], [3]]}, "prompt", "token-id"),
    ({"prompt": ["a", 1]}, "prompt", "string or a list of strings"),
    ({"prompt": ["x"] * 33}, "prompt", "limit of 32"),
    ({"logprobs": 6}, "logprobs", "0-5"),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"max_tokens": 5000}, "max_tokens", "context"),
    ({"temperature": 3}, "temperature", ""),
    ({"n": 9}, "n", ""),
    ({"suffix": "The end."}, "suffix", "insertion"),
    ({"best_of": 3}, "best_of", "best_of 3 with n 1"),
    ({"best_of": 1, "n": 2}, "best_of", ""),
    ({"echo": True, "logprobs": 1}, "echo", "prompt's own logprobs"),
    ({"logit_bias": {"50256": -100}}, "logit_bias", "not supported"),
])
def test_each_refusal_names_its_field(fields, param, says):
    with pytest.raises(OpenAIError) as err:
        req(**fields).check(1024)
    assert err.value.status == 400 and err.value.param == param and says in err.value.message


def test_what_asks_for_nothing_is_accepted():
    req(suffix="", best_of=2, n=2, echo=True, logit_bias={}, stream_options={"include_usage": True}).check(1024)


def test_unknown_fields_and_a_boolean_logprobs_are_invalid():
    with pytest.raises(ValidationError, match="extra_forbidden|Extra inputs"):
        req(messages=[])
    with pytest.raises(ValidationError, match="not a boolean"):
        req(logprobs=True)


def test_legacy_logprobs_object():
    """top_logprobs holds the chosen token and the alternatives (up to logprobs + 1 entries, as
    OpenAI says); text_offset counts characters, a character split over two tokens once."""
    entries = [TokenLogprob("Hi", -0.5, b"Hi", [TopLogprob("Hi", -0.5, b"Hi"), TopLogprob("Ho", -1.5, b"Ho")]),
               TokenLogprob("\ufffd", -0.25, b"\xc3", [TopLogprob("x", -0.1, b"x")]),
               TokenLogprob("\ufffd", float("-inf"), b"\xa9", []),
               TokenLogprob("!", -0.01, b"!", [])]
    offsets = Offsets()
    first = legacy_logprobs(entries[:2], offsets)
    assert first == {"tokens": ["Hi", "\ufffd"], "token_logprobs": [-0.5, -0.25],
                     "top_logprobs": [{"Hi": -0.5, "Ho": -1.5}, {"\ufffd": -0.25, "x": -0.1}], "text_offset": [0, 2]}
    rest = legacy_logprobs(entries[2:], offsets)  # a stream's next chunk goes on from the choice's offset
    assert rest["text_offset"] == [2, 3] and rest["token_logprobs"] == [-9999.0, -0.01]
    assert legacy_logprobs(None, Offsets()) is None


# -- the app in process -----------------------------------------------------------------------------

def echo_back(prompt: PromptRequest):
    """Choice j of a prompt answers "<prompt>|c<j>" in two chunks, with logprobs when asked."""
    lp = prompt.sampling.logprobs
    out = []
    for j in range(prompt.sampling.n):
        a, b = f"{prompt.raw_prompt}|", f"c{j}"
        out.append(piece(prompt, j, 0, a, logprobs=[token(a, -0.5, [(a, -0.5), ("z", -2.0)])] if lp else None))
        out.append(piece(prompt, j, 1, b, logprobs=[token(b, -0.25)] if lp else None, final=True, tokens_out=2,
                         finish=FinishReason.LENGTH))
    return out


def test_the_record_is_a_raw_prompt_without_messages(tmp_path):
    client = app_client(tmp_path, echo_back)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": ["one", "two"], "max_tokens": 4})
    assert r.status_code == 200, r.text
    records = [rec for _, rec in client.producer.sent if isinstance(rec, PromptRequest)]
    assert [(p.raw_prompt, p.messages, p.sampling.max_tokens) for p in records] == [("one", [], 4), ("two", [], 4)]
    assert records[0].conversation_id != records[1].conversation_id  # each a conversation of its own
    assert r.headers["X-Chatpipe-Request-Id"] == ",".join(p.request_id for p in records)


def test_a_list_of_prompts_with_n_choices(tmp_path):
    client = app_client(tmp_path, echo_back)
    answer = client.post("/v1/completions", json={"model": MODEL, "prompt": ["one", "two"], "n": 2}).json()
    assert answer["object"] == "text_completion" and answer["id"].startswith("cmpl-")
    assert [(c["index"], c["text"]) for c in answer["choices"]] == [
        (0, "one|c0"), (1, "one|c1"), (2, "two|c0"), (3, "two|c1")]
    assert {c["finish_reason"] for c in answer["choices"]} == {"length"}
    assert answer["usage"] == {"prompt_tokens": 14, "completion_tokens": 8, "total_tokens": 22,
                               "prompt_tokens_details": {"cached_tokens": 0}}
    assert all(c["logprobs"] is None for c in answer["choices"])


def test_logprobs_and_echo(tmp_path):
    client = app_client(tmp_path, echo_back)
    answer = client.post("/v1/completions", json={"model": MODEL, "prompt": "p", "logprobs": 1}).json()
    assert answer["choices"][0]["logprobs"] == {"tokens": ["p|", "c0"], "token_logprobs": [-0.5, -0.25],
                                                "top_logprobs": [{"p|": -0.5, "z": -2.0}, {"c0": -0.25}],
                                                "text_offset": [0, 2]}
    echoed = client.post("/v1/completions", json={"model": MODEL, "prompt": "p", "echo": True}).json()
    assert echoed["choices"][0]["text"] == "pp|c0"


def test_the_openai_client_streams_a_list_of_prompts(tmp_path):
    client = openai.OpenAI(base_url="http://testserver/v1", api_key=API_KEY, max_retries=0,
                           http_client=app_client(tmp_path, echo_back))
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    events = list(client.completions.create(model=MODEL, prompt=["one", "two"], n=2, stream=True, logprobs=0,
                                            stream_options={"include_usage": True}))
    for event in events[:-1]:
        assert event.object == "text_completion"
        (c,) = event.choices
        texts[c.index] = texts.get(c.index, "") + c.text
        if c.finish_reason:
            finish[c.index] = c.finish_reason
    assert texts == {0: "one|c0", 1: "one|c1", 2: "two|c0", 3: "two|c1"}
    assert finish == {i: "length" for i in range(4)}
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 8
    assert len({e.id for e in events}) == 1


def test_a_raw_stream_ends_with_done(tmp_path):
    client = app_client(tmp_path, echo_back)
    with client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "p", "stream": True,
                                                        "logprobs": 0}) as r:
        assert r.status_code == 200
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x)["choices"][0] for x in lines[:-1]]
    assert [c["logprobs"]["text_offset"] for c in chunks] == [[0], [2]]  # the second goes on from the first


def test_an_error_of_one_prompt_fails_the_request(tmp_path):
    def answer(prompt):
        if prompt.raw_prompt == "bad":
            return [piece(prompt, 0, 0, "", final=True, finish=FinishReason.ERROR, error_code="context_length_exceeded",
                          error="the raw prompt takes 2000 tokens")]
        return echo_back(prompt)
    r = app_client(tmp_path, answer).post("/v1/completions", json={"model": MODEL, "prompt": ["good", "bad"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_http_errors(tmp_path):
    client = app_client(tmp_path, echo_back)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "p", "frobnicate": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
    assert r.json()["error"]["param"] == "frobnicate"
    r = client.post("/v1/completions", json={"model": "gpt-17", "prompt": "p"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "p", "suffix": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert not [rec for _, rec in client.producer.sent if isinstance(rec, PromptRequest)]
