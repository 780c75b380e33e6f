"""The gateway's limits, through the real ``chatpipe gateway`` process on the session broker: each
bad request gets its 4xx in OpenAI's shape, with a message that says what to change, before
anything reaches Kafka; a body over the size limit gets 413; one tenant cannot take every slot of
the backlog.

Before: a 1 MB prompt got 500 ``internal error: KafkaException`` (the record was over the broker's
message size), ``max_tokens`` 10^9 a round trip to streams and "the budget of -999997952", a
10k-character user id and any body size were taken as they came, and one tenant's requests could
hold every backlog slot (429 for everybody else).

Behind the gateway is tests/gateway/fake_pipeline.py (no model needed: a refused request never
reaches the pipeline; the ones admitted are answered, or held, by conversation id).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from chatpipe.testing.gateway import API_KEY, OTHER_TENANT_KEY, start_gateway
from tests.gateway.fake_pipeline import FakePipeline, final

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m-instruct"
CONTEXT_TOKENS = 1024  # CHATPIPE_CONTEXT_TOKENS of this gateway: max_tokens at most 1023
MAX_PENDING, TENANT_SHARE = 4, 0.5  # one tenant holds at most 2
MAX_BODY_BYTES = 4 * 1024 * 1024  # the default


def answer(prompt):
    """ok-*: a one-chunk answer; hold-*: nothing (the request stays in flight); others: nothing."""
    if prompt.conversation_id.startswith("ok-"):
        return [final(prompt, "fine")]
    return None


@pytest.fixture(scope="module")
def gateway(kafka_settings, catalog_topics, tmp_path_factory):
    fake = FakePipeline(kafka_settings, answer).start()
    process = start_gateway(kafka_settings, tmp_path_factory.mktemp("limits"),
                            CHATPIPE_CONTEXT_TOKENS=str(CONTEXT_TOKENS),
                            CHATPIPE_GATEWAY_MAX_PENDING=str(MAX_PENDING),
                            CHATPIPE_GATEWAY_TENANT_SHARE=str(TENANT_SHARE),
                            CHATPIPE_GATEWAY_FIRST_CHUNK_TIMEOUT_S="30")
    try:
        process.wait_healthy(90)
        yield process, fake
        assert process.terminate() == 0, process.log()[-3000:]
    finally:
        process.terminate()
        fake.stop()


def auth(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def body(content: str = "hello", **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


def error_of(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


@pytest.mark.parametrize("request_body, param, code, says", [
    (body("a" * 1_000_000), "messages[0].content", "string_above_max_length",
     "is 1000000 characters, over the limit of 100000 per message; shorten it"),
    (body(max_tokens=10**9), "max_tokens", "integer_above_max_value",
     f"the context holds {CONTEXT_TOKENS} tokens for the prompt and the answer together, so set max_tokens to at "
     f"most {CONTEXT_TOKENS - 1}"),
    (body(max_completion_tokens=CONTEXT_TOKENS), "max_completion_tokens", "integer_above_max_value",
     f"set max_completion_tokens to at most {CONTEXT_TOKENS - 1}"),
    (body(user="u" * 10_000), "user", "string_above_max_length",
     "user is 10000 characters, over the limit of 256; use a shorter id"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 300}, "messages", "array_above_max_length",
     "messages has 300 messages, over the limit of 256; send fewer"),
    (body(stop=[f"s{i}" for i in range(17)]), "stop", "array_above_max_length",
     "stop has 17 stop strings, over the limit of 16; send fewer"),
    (body(stop=["x" * 300]), "stop[0]", "string_above_max_length", "over the limit of 256 per stop string"),
    (body(temperature=3), "temperature", "decimal_above_max_value", "temperature must be in [0, 2], got 3"),
    (body(top_p=0), "top_p", "decimal_below_min_value", "use a number above 0 and at most 1"),
    (body(metadata={"note": "n" * 600}), "metadata.note", "string_above_max_length", "over the limit of 512"),
    (body(metadata={"conversation_id": "not an id"}), "metadata.conversation_id", "invalid_value",
     "use 1-128 characters of A-Z a-z 0-9"),
])
async def test_each_bad_request_is_a_400_that_says_what_to_change_and_never_reaches_kafka(
        gateway, request_body, param, code, says):
    process, fake = gateway
    name = re.sub(r"[^A-Za-z0-9]", "-", param)
    conversation = f"refused-{name}"
    async with httpx.AsyncClient(base_url=process.url, timeout=60) as http:
        response = await http.post("/v1/chat/completions", json=request_body,
                                   headers={**auth(), "X-Chatpipe-Conversation-Id": conversation})
        assert response.status_code == 400, response.text
        error = error_of(response)
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
        assert says in error["message"], error["message"]
        # an admitted request after it is served: the refused one, had it been produced, would be seen by now
        ok = await http.post("/v1/chat/completions", json=body(), headers={**auth(), "X-Chatpipe-Conversation-Id":
                                                                         f"ok-after-{name}"})
        assert ok.status_code == 200, ok.text
    await asyncio.sleep(0.5)
    assert conversation not in fake.prompts, "a request refused at the gateway was produced to chat.prompts"


def raw_request(url: str, head: bytes, body_parts=()) -> tuple[int, dict]:
    """Send ``head`` and then ``body_parts`` on a socket of its own; the status and JSON body of the
    reply, read up to its Content-Length (the server may reset the connection after it: the test
    stops sending mid-body)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(head)
        for part in body_parts:
            sock.sendall(part)
        data = b""
        while True:
            data += sock.recv(65536)
            header, _, payload = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length: *(\d+)", header)
            if length and len(payload) >= int(length[1]):
                return int(header.split()[1]), json.loads(payload[:int(length[1])])


def test_a_declared_body_over_the_limit_is_a_413_before_it_is_read(gateway):
    """Content-Length over the limit: answered from the headers alone (the test sends no body)."""
    process, _ = gateway
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {50 * 1024 * 1024}\r\n\r\n").encode()
    status, reply = raw_request(process.url, head)
    error = reply["error"]
    assert (status, error["type"], error["code"]) == (413, "invalid_request_error", "request_too_large")
    assert f"the request body is {50 * 1024 * 1024} bytes" in error["message"]
    assert f"at most {MAX_BODY_BYTES} bytes (CHATPIPE_GATEWAY_MAX_BODY_BYTES)" in error["message"]


def test_a_chunked_body_over_the_limit_is_a_413_once_the_limit_is_passed(gateway):
    """No Content-Length: the gateway reads up to the limit, not the whole body."""
    process, _ = gateway
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    piece = b"a" * (256 * 1024)
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (MAX_BODY_BYTES // len(piece) + 1) + [b"0\r\n\r\n"]
    status, reply = raw_request(process.url, head, chunks)
    assert (status, reply["error"]["code"]) == (413, "request_too_large"), reply
    assert "sent without Content-Length" in reply["error"]["message"]


async def test_bodies_within_the_limit_are_served_with_and_without_content_length(gateway):
    process, _ = gateway
    payload = json.dumps(body("x " * 40_000)).encode()  # 80 kB, within every limit

    async def chunked():
        for i in range(0, len(payload), 16_384):
            yield payload[i:i + 16_384]

    async with httpx.AsyncClient(base_url=process.url, timeout=60) as http:
        for content in (payload, chunked()):
            response = await http.post("/v1/chat/completions", content=content,
                                       headers={**auth(), "Content-Type": "application/json",
                                                "X-Chatpipe-Conversation-Id": "ok-body"})
            assert response.status_code == 200, response.text
        big = await http.post("/v1/chat/completions", content=b" " * (MAX_BODY_BYTES + 1),
                              headers={**auth(), "Content-Type": "application/json"})
        assert big.status_code == 413 and error_of(big)["code"] == "request_too_large"
        assert (await http.get("/healthz")).status_code == 200  # and the gateway goes on serving


async def test_one_tenant_holds_at_most_its_share_of_the_backlog_and_others_are_served(gateway):
    """acme (share 0.5 of 4 = 2 slots) fills its share with requests the pipeline holds; its third
    gets 429 tenant_backlog_full naming the limit; globex is still admitted and served."""
    process, _ = gateway
    async with httpx.AsyncClient(base_url=process.url, timeout=60) as http:
        async def chat(key: str, conversation: str) -> httpx.Response:
            return await http.post("/v1/chat/completions", json=body(),
                                   headers={**auth(key), "X-Chatpipe-Conversation-Id": conversation})

        held = [asyncio.create_task(chat(API_KEY, f"hold-{i}")) for i in range(2)]
        deadline = time.monotonic() + 20
        while (await http.get("/healthz")).json()["pending"] < 2:
            assert time.monotonic() < deadline, "the held requests never became pending"
            await asyncio.sleep(0.1)

        busy = await chat(API_KEY, "ok-acme-third")
        assert busy.status_code == 429, busy.text
        error = error_of(busy)
        assert (error["type"], error["code"]) == ("rate_limit_error", "tenant_backlog_full")
        assert "tenant 'acme' has 2 requests in flight" in error["message"]
        assert "0.5 of max_pending 4 = 2; CHATPIPE_GATEWAY_TENANT_SHARE" in error["message"]
        assert int(busy.headers["Retry-After"]) >= 1

        other = await chat(OTHER_TENANT_KEY, "ok-globex")
        assert other.status_code == 200, other.text
        assert other.json()["choices"][0]["message"]["content"] == "fine"

        for task in held:  # the clients leave: their Cancels free acme's slots
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        deadline = time.monotonic() + 20
        while (await http.get("/healthz")).json()["pending"] > 0:
            assert time.monotonic() < deadline, "slots of clients that left were not freed"
            await asyncio.sleep(0.1)
        again = await chat(API_KEY, "ok-acme-again")
        assert again.status_code == 200, again.text
