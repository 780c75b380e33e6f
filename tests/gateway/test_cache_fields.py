"""Issue 43 in the gateway, without Kafka (the app in process: tests/gateway/inprocess.py): OpenAI's
``usage.prompt_tokens_details.cached_tokens`` from the final chunks, the ``X-Chatpipe-Cache: hit``
answer header of a response-cache hit, and the opt-out of streams' response cache (the
``X-Chatpipe-Cache`` request header, the body's ``cache``, the keys file's per-key ``response_cache``)
reaching ``PromptRequest.response_cache``. The real pipeline's cached tokens are
test_openai_client.py's.

Guards against: cached tokens dropped on the way (a usage without them, or summed over n choices,
or read from a chunk of an older version as None), a hit not said or said of a computed answer, an
opt-out lost (or a misspelt one passing as "cache"), a key's default ignored or overriding what the
request asked, a keys file whose ``"response_cache": "false"`` would read as true.
"""

from __future__ import annotations

import dataclasses
import json

import openai
import pytest

from gateway.keys import KeyStore, KeysFileError, Principal
from gateway.openai_api import OpenAIError
from gateway.responses import usage
from gateway.translate import CACHE_HEADER, cache_header, response_cache_of
from schemas.records import PromptRequest
from tests.gateway.inprocess import API_KEY, MODEL, app_client, piece

FRESH_KEY = "sk-inprocess-fresh"  # acme, "response_cache": false
KEYS = {FRESH_KEY: {"tenant": "acme", "response_cache": False}}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **fields}


def answered(cached_tokens: int | None = None, response_cached: bool = False, n: int = 1, per_choice=None):
    """An answer function: each choice one text chunk and a final one (``cached_tokens`` on the final,
    or ``per_choice[i]``), every chunk ``response_cached`` as asked."""
    def answer(prompt: PromptRequest):
        chunks = []
        for i in range(n):
            cached = per_choice[i] if per_choice is not None else cached_tokens
            chunks += [dataclasses.replace(piece(prompt, i, 0, f"c{i}"), response_cached=response_cached),
                       dataclasses.replace(piece(prompt, i, 1, "", final=True, tokens_out=1),
                                           cached_tokens=cached, response_cached=response_cached)]
        return chunks
    return answer


def prompts_sent(client) -> list[PromptRequest]:
    return [record for _, record in client.producer.sent if isinstance(record, PromptRequest)]


def sse_events(client, path: str, body: dict, **kw):
    with client.stream("POST", path, json=body, **kw) as r:
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
        headers = r.headers
    assert lines[-1] == "[DONE]"
    return headers, [json.loads(x) for x in lines[:-1]]


# -- usage ------------------------------------------------------------------------------------------

def test_usage_has_openais_prompt_tokens_details():
    assert usage(10, 3, 4) == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                               "prompt_tokens_details": {"cached_tokens": 4}}
    assert usage(10, 3)["prompt_tokens_details"] == {"cached_tokens": 0}  # present, 0 when none


def test_usage_carries_the_final_chunks_cached_tokens(tmp_path):
    client = app_client(tmp_path, answered(cached_tokens=5))
    r = client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    _, events = sse_events(client, "/v1/chat/completions",
                           chat(stream=True, stream_options={"include_usage": True}))
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    older = app_client(tmp_path, answered(cached_tokens=None))  # a final chunk before TokenChunk v4
    assert older.post("/v1/chat/completions", json=chat()).json()["usage"]["prompt_tokens_details"] == \
        {"cached_tokens": 0}


def test_the_openai_client_reads_cached_tokens(tmp_path):
    client = openai.OpenAI(base_url="http://testserver/v1", api_key=API_KEY, max_retries=0,
                           http_client=app_client(tmp_path, answered(cached_tokens=6)))
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert answer.usage.prompt_tokens == 7 and answer.usage.prompt_tokens_details.cached_tokens == 6
    completion = client.completions.create(model=MODEL, prompt="p")
    assert completion.usage.prompt_tokens_details.cached_tokens == 6


def test_n_choices_count_the_prompt_once(tmp_path):
    """Choice 0 computed the prompt (nothing cached); its siblings took its blocks: the prompt counts
    once, as the choice that computed it read it, like prompt_tokens."""
    client = app_client(tmp_path, answered(n=3, per_choice=[0, 16, 16]))
    u = client.post("/v1/chat/completions", json=chat(n=3)).json()["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]) == (7, 3, {"cached_tokens": 0})
    client = app_client(tmp_path, answered(n=2, per_choice=[32, 48]))  # a later turn: its prompt hit the cache
    assert client.post("/v1/chat/completions", json=chat(n=2)).json()["usage"]["prompt_tokens_details"] == \
        {"cached_tokens": 32}


def test_completions_sum_cached_tokens_over_the_prompts(tmp_path):
    cached = {"one": 3, "two": 4}
    client = app_client(tmp_path, lambda p: answered(cached_tokens=cached[p.raw_prompt])(p))
    u = client.post("/v1/completions", json={"model": MODEL, "prompt": ["one", "two"]}).json()["usage"]
    assert (u["prompt_tokens"], u["prompt_tokens_details"]) == (14, {"cached_tokens": 7})
    _, events = sse_events(client, "/v1/completions", {"model": MODEL, "prompt": ["one", "two"], "stream": True,
                                                        "stream_options": {"include_usage": True}})
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 7}


# -- X-Chatpipe-Cache: hit ----------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_a_response_cache_hit_says_so_in_a_header(tmp_path, stream):
    hit, computed = app_client(tmp_path, answered(7, response_cached=True)), app_client(tmp_path, answered(0))
    for path, body in (("/v1/chat/completions", chat(stream=stream)),
                       ("/v1/completions", {"model": MODEL, "prompt": "p", "stream": stream})):
        if stream:
            assert sse_events(hit, path, body)[0].get(CACHE_HEADER) == "hit"
            assert CACHE_HEADER not in sse_events(computed, path, body)[0]
        else:
            r = hit.post(path, json=body)
            assert r.status_code == 200 and r.headers.get(CACHE_HEADER) == "hit", (path, r.headers)
            assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 7}
            assert CACHE_HEADER not in computed.post(path, json=body).headers


def test_completions_say_hit_only_when_every_prompt_was(tmp_path):
    client = app_client(tmp_path, lambda p: answered(0, response_cached=p.raw_prompt == "one")(p))
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": ["one", "two"]})
    assert r.status_code == 200 and CACHE_HEADER not in r.headers
    both = client.post("/v1/completions", json={"model": MODEL, "prompt": ["one", "one"]})
    assert both.headers.get(CACHE_HEADER) == "hit"


# -- the opt-out ----------------------------------------------------------------------------------

@pytest.mark.parametrize("value, asked", [("off", False), ("no-store", False), ("OFF", False), (" no-store ", False),
                                          ("on", True), ("default", None), (None, None)])
def test_the_cache_header_values(value, asked):
    assert cache_header(value) is asked


@pytest.mark.parametrize("value", ["false", "0", "none", "", "of", "hit"])
def test_any_other_cache_header_is_a_400_naming_it(value):
    with pytest.raises(OpenAIError) as caught:
        cache_header(value)
    e = caught.value
    assert (e.status, e.param, e.code) == (400, CACHE_HEADER, "invalid_value")
    assert "off" in e.message and "no-store" in e.message and repr(value) in e.message


@pytest.mark.parametrize("header, body, key_default, expected", [
    (None, None, True, True), (None, None, False, False),  # the key's default
    (False, None, True, False), (None, False, True, False),  # an opt-out
    (True, None, False, True), (None, True, False, True),  # opting in against the key
    (True, False, True, False), (False, True, False, False),  # the two disagree: the opt-out wins
])
def test_what_the_request_says_wins_over_its_keys_default(header, body, key_default, expected):
    assert response_cache_of(header, body, Principal("acme", "u", response_cache=key_default)) is expected


def test_the_opt_out_reaches_the_prompt_request(tmp_path):
    client = app_client(tmp_path, answered(0), keys=KEYS)
    fresh = {"Authorization": f"Bearer {FRESH_KEY}"}
    cases = [  # (headers, extra body fields, PromptRequest.response_cache)
        ({}, {}, True),
        ({CACHE_HEADER: "off"}, {}, False),
        ({CACHE_HEADER: "no-store"}, {}, False),
        ({}, {"cache": False}, False),
        ({CACHE_HEADER: "on"}, {"cache": False}, False),
        (fresh, {}, False),
        ({**fresh, CACHE_HEADER: "on"}, {}, True),
        (fresh, {"cache": True}, True),
        ({**fresh, CACHE_HEADER: "default"}, {}, False),
    ]
    for headers, fields, expected in cases:
        for path, body in (("/v1/chat/completions", chat(**fields)),
                           ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"], **fields})):
            before = len(prompts_sent(client))
            r = client.post(path, json=body, headers=headers)
            assert r.status_code == 200, r.text
            sent = prompts_sent(client)[before:]
            assert sent and {p.response_cache for p in sent} == {expected}, (path, headers, fields)


def test_a_bad_opt_out_is_a_400_before_anything_is_sent(tmp_path):
    client = app_client(tmp_path, answered(0))
    for path, body in (("/v1/chat/completions", chat()), ("/v1/completions", {"model": MODEL, "prompt": "p"})):
        r = client.post(path, json=body, headers={CACHE_HEADER: "nope"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == CACHE_HEADER and set(r.json()["error"]) == {"message", "type", "param",
                                                                                          "code"}
        r = client.post(path, json={**body, "cache": "no"})  # a boolean or nothing: "no" must not pass as true
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache", r.text
    assert prompts_sent(client) == []


# -- the keys file ------------------------------------------------------------------------------------

def test_keys_of_one_tenant_may_differ_in_their_response_cache_default(tmp_path):
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({"sk-a": {"tenant": "acme", "response_cache": False},
                                     "sk-b": {"tenant": "acme", "response_cache": True},
                                     "sk-c": "acme"}))
    store = KeyStore.load(keys_file)
    assert [store.lookup(f"Bearer {k}").response_cache for k in ("sk-a", "sk-b", "sk-c")] == [False, True, True]


@pytest.mark.parametrize("value", ["false", 0, None, "off"])
def test_a_response_cache_that_is_not_a_boolean_stops_the_load(tmp_path, value):
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({"sk-a": {"tenant": "acme", "response_cache": value}}))
    with pytest.raises(KeysFileError, match="response_cache"):
        KeyStore.load(keys_file)
