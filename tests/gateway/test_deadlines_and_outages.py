"""The gateway process against a real broker, with a fake pipeline behind it (no model needed):
every prompt carries its deadline, an answer that says "expired" is a 504, and a broker that goes
away gives prompt 503s that free the backlog instead of holding each slot for five minutes.

The gateway is the real ``chatpipe gateway`` process (chatpipe/testing/gateway.py); what answers its
prompts is tests/gateway/fake_pipeline.py, a stand-in for streams and the worker. Why not the real
tiers: these tests need an answer the real ones give only by chance of timing (an "expired" final
chunk for a prompt the gateway has just sent with a fresh deadline, or no answer at all for a
known time); the real tiers' expiry is tested against them in tests/worker and tests/streams, and
the whole path in tests/faults. The outage test stops and restarts a broker of its own.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from chatpipe.testing.gateway import API_KEY, start_gateway
from chatpipe.testing.ports import free_port
from schemas.records import FinishReason
from tests.gateway.fake_pipeline import FakePipeline, final
from transport.settings import KafkaSettings

pytestmark = pytest.mark.integration
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "smollm2-135m-instruct"


def answer_by_conversation(prompt):
    """ok-*: a two-chunk answer; expired-*: what a tier sends for a request taken after its deadline;
    silent-*: nothing; anything else (other tests' prompts on the session's topics): nothing."""
    kind = prompt.conversation_id.split("-")[0]
    if kind == "ok":
        first = final(prompt, "fine ")
        first.is_final, first.finish_reason = False, None
        return [first, final(prompt, "thanks", index=1)]
    if kind == "expired":
        return [final(prompt, finish_reason=FinishReason.TIMEOUT, error_code="expired",
                      error="the request's deadline passed 2 s before a worker took it")]
    return None


async def chat(http: httpx.AsyncClient, conversation: str, *, stream: bool = False) -> tuple[httpx.Response, float]:
    """One request and how long its answer took (s). A streamed one is read to the end."""
    started = time.monotonic()
    body = {"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": "hello"}]}
    headers = {**AUTH, "X-Chatpipe-Conversation-Id": conversation}
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        await response.aread()
    return response, time.monotonic() - started


def error_of(response: httpx.Response) -> tuple[int, str, str]:
    error = response.json()["error"]
    return response.status_code, error["type"], error["code"]


async def test_prompts_carry_their_deadline_and_an_expired_answer_is_a_504(kafka_settings, catalog_topics, tmp_path):
    """No request used to carry a deadline, so work re-read after an outage was served for clients
    long gone. Each PromptRequest must say when its client stops waiting (the first-token timeout),
    the client must get its 504 at that moment, and a tier's "expired" answer must be a 504 too,
    streamed or not (it comes before any token, so it is a real HTTP status, not a broken stream)."""
    fake = FakePipeline(kafka_settings, answer_by_conversation).start()
    gateway = start_gateway(kafka_settings, tmp_path, CHATPIPE_GATEWAY_FIRST_CHUNK_TIMEOUT_S="6")
    try:
        gateway.wait_healthy(90)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            ok, _ = await chat(http, "ok-1")
            assert ok.status_code == 200, ok.text
            assert ok.json()["choices"][0]["message"]["content"] == "fine thanks"
            prompt = fake.prompts["ok-1"]
            assert prompt.deadline_at == prompt.created_at + 6000
            assert prompt.reply_to.startswith(kafka_settings.topic("chat.replies.")) and prompt.reply_partition == 0

            for conversation, stream in (("expired-1", False), ("expired-2", True)):
                response, took = await chat(http, conversation, stream=stream)
                assert error_of(response) == (504, "server_error", "expired"), response.text
                assert "deadline passed" in response.json()["error"]["message"]
                assert took < 5, "an expired answer must come at once, not at the gateway's own timeout"

            silent, _ = await chat(http, "silent-1")
            answered_at_ms = time.time() * 1000
            assert error_of(silent) == (504, "server_error", "timeout"), silent.text
            deadline = fake.prompts["silent-1"].deadline_at
            assert deadline - 100 <= answered_at_ms <= deadline + 2000, \
                f"504 {answered_at_ms - deadline:.0f} ms after the deadline the prompt carried"

            health = (await http.get("/healthz")).json()
            assert health["pending"] == 0
            metrics = (await http.get("/metrics")).text
            assert 'chatpipe_gateway_requests_total{outcome="expired"} 2.0' in metrics
        assert gateway.terminate() == 0, gateway.log()[-3000:]
    finally:
        gateway.terminate()
        fake.stop()


@pytest.fixture
def own_broker(tmp_path):
    """A broker of this test's own (it is stopped and restarted), on free ports."""
    from infra.local_kafka import LocalKafka
    from infra.settings import StackSettings

    broker = LocalKafka(StackSettings(state_dir=tmp_path / "state", kafka_port=free_port(),
                                      controller_port=free_port()))
    broker.up()
    yield broker
    broker.down()


async def test_with_the_broker_away_requests_get_a_prompt_503_and_free_the_backlog(own_broker, tmp_path):
    """The gateway kept librdkafka's 300 s delivery timeout: with the broker down every request held
    a backlog slot for five minutes before its 503, and the gateway answered 429 to everybody
    meanwhile. Now each gets 503 kafka_unavailable within the gateway's delivery timeout (default
    5 s), its slot is free again, and once the broker is back requests are served as before."""
    from transport.admin import TopicAdmin

    kafka = KafkaSettings(bootstrap_servers=own_broker.settings.bootstrap_servers, topic_prefix="away.")
    TopicAdmin(kafka).apply()
    fake = FakePipeline(kafka, answer_by_conversation).start()
    # One tenant here: the whole backlog is its share (the per-tenant cap is tests/gateway/test_limits.py).
    gateway = start_gateway(kafka, tmp_path, CHATPIPE_GATEWAY_MAX_PENDING="3", CHATPIPE_GATEWAY_TENANT_SHARE="1")
    try:
        gateway.wait_healthy(90)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            before, _ = await chat(http, "ok-before")
            assert before.status_code == 200, before.text

            own_broker.down()
            held = [asyncio.create_task(chat(http, f"ok-away-{i}")) for i in range(3)]
            await asyncio.sleep(1.0)
            busy, _ = await chat(http, "ok-busy")
            assert error_of(busy)[::2] == (429, "backlog_full"), "the three in flight hold the backlog"
            for response, took in await asyncio.gather(*held):
                assert error_of(response) == (503, "server_error", "kafka_unavailable"), response.text
                assert took < 12, f"503 after {took:.1f} s (the delivery timeout is 5 s)"
            assert (await http.get("/healthz")).json()["pending"] == 0
            again, took = await chat(http, "ok-again")
            assert error_of(again)[::2] == (503, "kafka_unavailable") and took < 12, "the slots must be free"

            own_broker.up()
            deadline = time.monotonic() + 120
            while True:  # the producer reconnects with backoff: the first tries may still 503
                try:
                    back, _ = await chat(http, "ok-back")
                except httpx.TimeoutException as exc:  # seen once, in a suite run beside the first Go builds
                    raise AssertionError(
                        f"no answer within 60 s after the broker came back ({exc!r}); the fake pipeline saw "
                        f"{sorted(fake.prompts)}, errors {fake.errors!r}; gateway log:\n{gateway.log()[-4000:]}"
                    ) from exc
                if back.status_code != 503 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(1)
            assert back.status_code == 200, back.text
            assert back.json()["choices"][0]["message"]["content"] == "fine thanks"
        assert gateway.terminate() == 0, gateway.log()[-3000:]
    finally:
        gateway.terminate()
        fake.stop()


async def test_a_deleted_reply_topic_stops_the_gateway_instead_of_leaving_it_deaf(kafka_settings, catalog_topics,
                                                                                 tmp_path):
    """The reply reader used to log consumer errors forever (or nothing: librdkafka says nothing about a
    deleted topic it was assigned) while /healthz said 200 and every request waited out its timeout.
    With its topic deleted, the request waiting gets a 503 within the reader's budget and the process
    exits 1 for its supervisor to start it again."""
    from transport import clients

    fake = FakePipeline(kafka_settings, answer_by_conversation).start()
    gateway = start_gateway(kafka_settings, tmp_path, CHATPIPE_GATEWAY_REPLY_ERROR_BUDGET_S="3")
    try:
        gateway.wait_healthy(90)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            ok, _ = await chat(http, "ok-first")
            assert ok.status_code == 200, ok.text
            reply_topic = (await http.get("/healthz")).json()["reply_topic"]
            waiting = asyncio.create_task(chat(http, "silent-deaf"))  # never answered: it waits on the reader
            await asyncio.sleep(1.0)
            admin = clients.admin(kafka_settings)  # kept: a collected client ends its futures (_DESTROY)
            admin.delete_topics([reply_topic])[reply_topic].result(timeout=30)
            response, took = await waiting
            assert error_of(response) == (503, "server_error", "gateway_unavailable"), response.text
            assert took < 30, f"503 after {took:.1f} s; the reader's budget is 3 s"
            assert "UNKNOWN_TOPIC_OR_PART" in response.json()["error"]["message"]
        assert gateway.proc.wait(timeout=30) == 1, gateway.log()[-3000:]
        assert "reply reader of" in gateway.log() and "stopped" in gateway.log()
    finally:
        gateway.terminate()
        fake.stop()


async def test_with_no_worker_reporting_requests_get_503_at_once_and_are_served_once_one_reports(
        kafka_settings, tmp_path):
    """Admission (gateway/admission.py): a model no worker serves cannot answer, so its requests get 503
    no_worker at once instead of a 504 after the whole first-token timeout. The workers' reports decide:
    none fresher than worker_stale_s (2 s here) means none."""
    from transport.admin import TopicAdmin

    kafka = kafka_settings.model_copy(update={"topic_prefix": f"{kafka_settings.topic_prefix}noworker."})
    TopicAdmin(kafka).apply()  # topics of its own: no other test's worker reports here
    gateway = start_gateway(kafka, tmp_path, CHATPIPE_GATEWAY_WORKER_STALE_S="2")
    fake = None
    try:
        gateway.wait_healthy(90)
        await asyncio.sleep(2.5)  # the first report period: before it ends, nothing known refuses nothing
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            refused, took = await chat(http, "ok-nobody")
            assert error_of(refused) == (503, "server_error", "no_worker"), refused.text
            assert took < 1, f"503 after {took:.2f} s: it must not wait for a worker"
            assert refused.headers["Retry-After"] == "2"
            fake = FakePipeline(kafka, answer_by_conversation).start()  # reports every second, as a worker
            deadline = time.monotonic() + 30
            while True:
                served, _ = await chat(http, "ok-somebody")
                if served.status_code != 503 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            assert served.status_code == 200, served.text
            fake.stop()
            fake = None
            await asyncio.sleep(3)  # its last report goes stale
            gone, took = await chat(http, "ok-gone")
            assert error_of(gone) == (503, "server_error", "no_worker") and took < 1, gone.text
            metrics = (await http.get("/metrics")).text
            refused_count = re.search(r'chatpipe_gateway_requests_total\{outcome="rejected_no_worker"\} (\S+)', metrics)
            assert refused_count and float(refused_count.group(1)) >= 2, metrics
        assert gateway.terminate() == 0, gateway.log()[-3000:]
    finally:
        gateway.terminate()
        if fake is not None:
            fake.stop()
