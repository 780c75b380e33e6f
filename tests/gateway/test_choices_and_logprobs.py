"""How the gateway assembles ``n`` choices and their logprobs from TokenChunks (schema v3:
``choice_index``, ``logprobs``), not streamed and streamed, parsed by the official ``openai``
client. No Kafka, no model (the app in process: tests/gateway/inprocess.py).

Guards against: choices mixed up when their chunks interleave, a request that ends at the first
choice's final chunk, usage counting one choice only, logprobs dropped or repeated after a retried
attempt, bytes not as OpenAI's list of ints, and an error of one choice not failing the request.
"""

from __future__ import annotations

import json

import openai
import pytest

from gateway.service import LogprobsShown
from schemas.records import FinishReason
from tests.gateway.inprocess import API_KEY, MODEL, app_client, piece, token


def three_choices(prompt):
    """Choice i answers "c<i>-a c<i>-b" in two chunks, the choices interleaved; choice 2 hits its length."""
    lp = prompt.sampling.logprobs
    chunks = []
    for step in range(2):
        for i in range(prompt.sampling.n):
            text = f"c{i}-{'ab'[step]}" if step == 0 else f" c{i}-b"
            logprobs = [token(text, -0.5 * (i + 1), [(text, -0.5 * (i + 1)), ("x", -3.0)])] if lp else None
            if step == 0:
                chunks.append(piece(prompt, i, 0, text, logprobs=logprobs))
            else:
                chunks.append(piece(prompt, i, 1, text, logprobs=logprobs, final=True, tokens_out=2,
                                    finish=FinishReason.LENGTH if i == 2 else FinishReason.STOP))
    return chunks


def body(**fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **fields}


def test_n_choices_each_with_its_text_finish_and_logprobs(tmp_path):
    client = app_client(tmp_path, three_choices)
    r = client.post("/v1/chat/completions", json=body(n=3, logprobs=True, top_logprobs=2))
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in answer["choices"]] == [f"c{i}-a c{i}-b" for i in range(3)]
    assert [c["finish_reason"] for c in answer["choices"]] == ["stop", "stop", "length"]
    assert answer["usage"] == {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13,
                               "prompt_tokens_details": {"cached_tokens": 0}}  # chunks without it: 0
    content = answer["choices"][1]["logprobs"]["content"]
    assert answer["choices"][1]["logprobs"]["refusal"] is None
    assert [e["token"] for e in content] == ["c1-a", " c1-b"]
    assert content[0] == {"token": "c1-a", "logprob": -1.0, "bytes": list(b"c1-a"),
                          "top_logprobs": [{"token": "c1-a", "logprob": -1.0, "bytes": list(b"c1-a")},
                                           {"token": "x", "logprob": -3.0, "bytes": [120]}]}


def test_without_logprobs_asked_they_are_null(tmp_path):
    client = app_client(tmp_path, three_choices)
    answer = client.post("/v1/chat/completions", json=body()).json()
    assert len(answer["choices"]) == 1 and answer["choices"][0]["logprobs"] is None


def test_the_openai_client_parses_choices_and_logprobs(tmp_path):
    client = openai.OpenAI(base_url="http://testserver/v1", api_key=API_KEY, max_retries=0,
                           http_client=app_client(tmp_path, three_choices))
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=3,
                                            logprobs=True, top_logprobs=2)
    assert len(answer.choices) == 3
    first = answer.choices[0].logprobs.content[0]
    assert first.token == "c0-a" and first.logprob == -0.5 and first.bytes == list(b"c0-a")
    assert [t.token for t in first.top_logprobs] == ["c0-a", "x"]


def test_a_stream_of_n_choices_with_logprobs(tmp_path):
    """Each choice: a role chunk, its content chunks (index, logprobs.content of their tokens), its
    finish reason; usage over all choices once every choice ended, then [DONE]."""
    client = app_client(tmp_path, three_choices)
    with client.stream("POST", "/v1/chat/completions", json=body(n=3, logprobs=True, stream=True,
                                                                 stream_options={"include_usage": True})) as r:
        assert r.status_code == 200
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(x) for x in lines[:-1]]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    by_choice: dict[int, list[dict]] = {}
    for e in events[:-1]:
        (c,) = e["choices"]
        by_choice.setdefault(c["index"], []).append(c)
    assert sorted(by_choice) == [0, 1, 2]
    for i, chunks in by_choice.items():
        assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content") or "" for c in chunks) == f"c{i}-a c{i}-b"
        tokens = [t["token"] for c in chunks if c["logprobs"] for t in c["logprobs"]["content"]]
        assert tokens == [f"c{i}-a", f" c{i}-b"]
        assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["length" if i == 2 else "stop"]
        assert chunks[-1]["finish_reason"] is not None  # nothing of a choice after its finish


def test_the_openai_client_streams_n_choices(tmp_path):
    client = openai.OpenAI(base_url="http://testserver/v1", api_key=API_KEY, max_retries=0,
                           http_client=app_client(tmp_path, three_choices))
    texts = {0: "", 1: "", 2: ""}
    for event in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=3,
                                                stream=True):
        for c in event.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {i: f"c{i}-a c{i}-b" for i in range(3)}


def test_an_error_in_one_choice_fails_the_request(tmp_path):
    def answer(prompt):
        return [piece(prompt, 0, 0, "fine", final=True, tokens_out=1),
                piece(prompt, 1, 0, "", final=True, finish=FinishReason.ERROR, error_code="internal_error",
                      error="the engine failed")]
    r = app_client(tmp_path, answer).post("/v1/chat/completions", json=body(n=2))
    assert r.status_code == 500 and "the engine failed" in r.json()["error"]["message"]


def test_a_request_waits_for_every_choice(tmp_path):
    """The first choice's final chunk must not end an n=2 request: the second's text would be lost."""
    def answer(prompt):
        return [piece(prompt, 0, 0, "one", final=True, tokens_out=1),
                piece(prompt, 1, 0, "tw"), piece(prompt, 1, 1, "o", final=True, tokens_out=2)]
    answer_ = app_client(tmp_path, answer).post("/v1/chat/completions", json=body(n=2)).json()
    assert [c["message"]["content"] for c in answer_["choices"]] == ["one", "two"]
    assert answer_["usage"]["completion_tokens"] == 3


def test_logprobs_of_a_retried_attempt_are_not_repeated(tmp_path):
    """A worker died after two tokens; the retry streams all three from index 0: the client gets
    three entries, not five (as the text is shown once, by AnswerText)."""
    def answer(prompt):
        return [piece(prompt, 0, 0, "Hel", logprobs=[token("Hel", -0.1)]),
                piece(prompt, 0, 1, "lo", logprobs=[token("lo", -0.2)]),
                piece(prompt, 0, 0, "Hel", logprobs=[token("Hel", -0.1)]),
                piece(prompt, 0, 1, "lo", logprobs=[token("lo", -0.2)]),
                piece(prompt, 0, 2, "!", logprobs=[token("!", -0.3)], final=True, tokens_out=3)]
    client = app_client(tmp_path, answer, attempts={0: "dead", 1: "dead", 2: "retry", 3: "retry", 4: "retry"})
    choice = client.post("/v1/chat/completions", json=body(logprobs=True)).json()["choices"][0]
    assert choice["message"]["content"] == "Hello!"
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["Hel", "lo", "!"]


def test_logprobs_shown_counts_entries_across_attempts():
    shown = LogprobsShown()

    class C:
        def __init__(self, n):
            self.logprobs = [token(str(i), -1.0) for i in range(n)]

    assert len(shown.feed(C(2), "a")) == 2
    assert len(shown.feed(C(1), "b")) == 0  # the retry's first token: already shown
    assert len(shown.feed(C(2), "b")) == 1  # its second and third: the third is new


def test_a_token_the_model_gives_no_chance_is_minus_9999_not_invalid_json(tmp_path):
    def answer(prompt):
        return [piece(prompt, 0, 0, "x", logprobs=[token("x", float("-inf"), [("y", float("-inf"))])], final=True,
                      tokens_out=1)]
    r = app_client(tmp_path, answer).post("/v1/chat/completions", json=body(logprobs=True, top_logprobs=1))
    entry = json.loads(r.text)["choices"][0]["logprobs"]["content"][0]
    assert entry["logprob"] == -9999.0 and entry["top_logprobs"][0]["logprob"] == -9999.0


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_request_is_still_a_4xx_before_any_chunk(tmp_path, stream):
    def answer(prompt):
        return [piece(prompt, 0, 0, "", final=True, finish=FinishReason.ERROR, error_code="context_length_exceeded",
                      error="the prompt is 3000 tokens")]
    r = app_client(tmp_path, answer).post("/v1/chat/completions", json=body(n=2, stream=stream))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
