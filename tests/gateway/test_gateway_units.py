"""Pieces of the gateway that need no services: the keys file, how a retried answer is shown, the
deadline and errors of a request."""

from __future__ import annotations

import json

import pytest

from gateway.keys import KeysFileError, KeyStore
from schemas.records import TokenChunk
from transport.dedupe import AnswerText


def chunk(index: int, text: str, final: bool = False) -> TokenChunk:
    return TokenChunk(request_id="r", conversation_id="c", index=index, text=text, is_final=final, worker_id="w")


def test_keys_map_to_tenants_and_default_users(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-a": {"tenant": "acme", "user": "ada"}, "sk-b": "globex"}))
    keys = KeyStore.load(path)
    assert keys.lookup("Bearer sk-a").tenant == "acme" and keys.lookup("Bearer sk-a").user_id == "ada"
    b = keys.lookup("bearer sk-b")
    assert b.tenant == "globex" and b.user_id.startswith("key-") and "sk-b" not in b.user_id
    assert keys.lookup("Bearer sk-c") is None and keys.lookup(None) is None and keys.lookup("sk-a") is None


@pytest.mark.parametrize("content", ["", "[]", "{}", '{"sk-a": {}}', "not json"])
def test_bad_keys_files_are_named_errors(tmp_path, content):
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(KeysFileError, match="keys file"):
        KeyStore.load(path)
    with pytest.raises(KeysFileError, match="does not exist"):
        KeyStore.load(tmp_path / "missing.json")


def test_answer_text_in_order_and_duplicates_dropped():
    answer = AnswerText()
    shown = [answer.feed(chunk(i, t), "a1") for i, t in enumerate(["Hel", "lo", " you"])]
    assert shown == ["Hel", "lo", " you"]
    assert answer.feed(chunk(1, "lo"), "a1") is None  # a duplicate delivery


def test_a_retried_attempt_continues_where_the_client_is_and_the_dead_one_is_ignored():
    """A worker died after streaming 'Hello'; the retry streams 'Hello world' from index 0: the
    client must see 'Hello world' once, and late chunks of the dead attempt must not interleave."""
    answer = AnswerText()
    assert answer.feed(chunk(0, "Hel"), "dead") == "Hel"
    assert answer.feed(chunk(1, "lo"), "dead") == "lo"
    retry = [answer.feed(chunk(i, t, final=(i == 2)), "retry") for i, t in enumerate(["He", "llo w", "orld"])]
    assert retry == ["", " w", "orld"]
    assert answer.feed(chunk(2, " there"), "dead") is None


def test_the_gateway_serves_the_model_name_the_worker_answers_under():
    """The gateway keeps its own copy of the default model's name (it does not import the engine):
    a rename on one side only would make every request a 404 model_not_found."""
    from inference.engine.settings import DEFAULT_MODEL_NAME
    from gateway.settings import DEFAULT_MODEL, GatewaySettings

    assert DEFAULT_MODEL == DEFAULT_MODEL_NAME
    assert GatewaySettings().models == [DEFAULT_MODEL_NAME]


class FakeProducer:
    """Takes what the gateway sends; every send is acknowledged at once."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    def send(self, topic, record, *, want_ack=True, **_):
        import asyncio

        self.sent.append((topic, record))
        if want_ack:
            future = asyncio.get_running_loop().create_future()
            future.set_result(None)
            return future
        return None


class FakeReader:
    def __init__(self) -> None:
        self.queues = {}
        self.failure = None  # a ReplyReader's: why it stopped

    def register(self, request_id):
        import asyncio

        self.queues[request_id] = asyncio.Queue()
        return self.queues[request_id]

    def unregister(self, request_id):
        self.queues.pop(request_id, None)


def service_without_kafka(**settings):
    from gateway.metrics import GatewayMetrics
    from gateway.service import GatewayService
    from gateway.settings import GatewaySettings
    from transport.settings import KafkaSettings

    service = GatewayService(KafkaSettings(), GatewaySettings(**settings), GatewayMetrics())
    service.reply_topic, service.producer, service.reader = "chat.replies.gw", FakeProducer(), FakeReader()
    return service


def completion_request():
    from gateway.openai_api import ChatCompletionRequest

    return ChatCompletionRequest(model="smollm2-135m-instruct", messages=[{"role": "user", "content": "hi"}])


async def test_every_prompt_carries_the_deadline_at_which_the_client_gets_its_504():
    """No request carried a deadline, so a tier re-reading old work served requests whose clients
    had left long ago. The deadline is the gateway's first-token timeout, and the 504 comes then."""
    import time

    from gateway.keys import Principal
    from gateway.openai_api import OpenAIError

    service = service_without_kafka(first_chunk_timeout_s=0.5)
    sub = await service.submit(Principal("acme", "ada"), completion_request(), "conv-1", time.perf_counter())
    ((topic, prompt),) = service.producer.sent
    assert topic == "chat.prompts" and prompt.schema_version == 8
    assert prompt.deadline_at == prompt.created_at + 500 == sub.deadline_at
    with pytest.raises(OpenAIError) as caught:
        await anext(service.replies(sub))
    late_ms = time.time() * 1000 - prompt.deadline_at
    assert (caught.value.status, caught.value.code) == (504, "timeout")
    assert -50 < late_ms < 400, f"the 504 came {late_ms:.0f} ms after the deadline"
    assert not service.pending


async def test_an_answer_that_says_expired_is_a_504():
    """A tier that took the request after its deadline answers a final chunk with finish reason
    TIMEOUT and error code "expired": the client gets 504 "expired", not a 500 or an empty answer."""
    import time

    from gateway.keys import Principal
    from gateway.openai_api import OpenAIError
    from gateway.replies import Reply
    from schemas.records import FinishReason

    service = service_without_kafka()
    sub = await service.submit(Principal("acme", "ada"), completion_request(), "conv-1", time.perf_counter())
    expired = TokenChunk(request_id=sub.request_id, conversation_id="conv-1", index=0, text="", is_final=True,
                         worker_id="w", finish_reason=FinishReason.TIMEOUT, tokens_in=0, tokens_out=0,
                         error_code="expired", error="deadline passed 2 s before the worker took it")
    sub.queue.put_nowait(Reply(expired, "a1"))
    with pytest.raises(OpenAIError) as caught:
        await anext(service.replies(sub))
    error = caught.value
    assert (error.status, error.type, error.code) == (504, "server_error", "expired")
    assert "deadline passed 2 s" in error.message


async def test_a_stopped_reply_reader_fails_the_waiting_requests_and_stops_the_gateway():
    """The reply reader's thread used to end silently (or log errors forever) while /healthz said 200 and
    every request waited out its 300 s. Once it stops: the waiting request gets 503 gateway_unavailable,
    the gateway is not ready, new requests get 503, and ``on_failure`` runs (server.py: uvicorn stops and
    the process exits 1). The real reader's stop on a deleted topic: test_deadlines_and_outages.py."""
    import time

    from gateway.keys import Principal
    from gateway.openai_api import OpenAIError
    from gateway.replies import ReplyReader
    from schemas.codec import default_codec
    from transport.errors import TransportError
    from transport.settings import KafkaSettings

    service = service_without_kafka()
    reader = service.reader = ReplyReader(KafkaSettings(), "chat.replies.gw", default_codec())
    reader.ready, reader._on_failure = True, service._reader_stopped  # what start() sets, without a broker
    stopped: list[BaseException] = []
    service.on_failure = stopped.append
    sub = await service.submit(Principal("acme", "ada"), completion_request(), "conv-1", time.perf_counter())
    assert service.ready

    reader._stopped(TransportError("tail consumer of chat.replies.gw: UNKNOWN_TOPIC_OR_PART"))
    with pytest.raises(OpenAIError) as caught:
        await anext(service.replies(sub))
    assert (caught.value.status, caught.value.code) == (503, "gateway_unavailable")
    assert "UNKNOWN_TOPIC_OR_PART" in caught.value.message
    assert len(stopped) == 1 and not service.ready and not service.pending
    with pytest.raises(OpenAIError) as refused:
        await service.submit(Principal("acme", "ada"), completion_request(), "conv-2", time.perf_counter())
    assert (refused.value.status, refused.value.code) == (503, "gateway_unavailable")


def test_the_gateway_gives_up_producing_within_seconds_by_default():
    """librdkafka's own delivery timeout is 300 s: a request would hold its backlog slot that long."""
    from gateway.settings import GatewaySettings

    assert GatewaySettings().delivery_timeout_s <= 10
