"""The response cache on the real stack (issue 43): a Redis server, Kafka, ``chatpipe streams`` with
``CHATPIPE_CACHE_URL``, an inference worker with the default model, a gateway; requests through the gateway.

A pipeline of its own (the gateway tests' runs without a cache: their answers must come from a worker),
on the session's broker under a topic prefix of its own, and a ``redis-server`` of its own
(``chatpipe.testing.redis``). Every question here is greedy with a few tokens, and each test's users and
questions carry a run id, so no test sees another's entries.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import httpx
import pytest

from chatpipe.testing.streams import REPO, Tap
from schemas.records import ConversationTurn
from schemas.topics import INFERENCE_REQUESTS, TURNS

pytestmark = [pytest.mark.integration, pytest.mark.model]
MODEL = "smollm2-135m-instruct"
CACHE_WORKER = "streams.response-cache"


@pytest.fixture(scope="module")
def stack(kafka_stack, tmp_path_factory):
    from chatpipe.testing.gateway import start_pipeline
    from chatpipe.testing.redis import RedisServer
    from transport.admin import TopicAdmin
    from transport.settings import KafkaSettings

    root = tmp_path_factory.mktemp("cache-stack")
    kafka = KafkaSettings(bootstrap_servers=kafka_stack.bootstrap_servers, topic_prefix=f"rc{uuid.uuid4().hex[:8]}.")
    TopicAdmin(kafka).apply()
    with RedisServer(root) as redis:
        # retry_after_s short: the kill test sees the cache used again within seconds of Redis coming back
        # worker_stale_s 120: in two loaded fresh-clone runs (4 test workers on 2 cores) the gateway answered 503
        # no_worker while the worker's traces show a status sent every second: the gateway's status reader went
        # 30 s without one (not yet explained; noted for the next session). This file tests the cache.
        pipeline = start_pipeline(kafka, root, streams_env={"CHATPIPE_CACHE_URL": redis.url,
                                                            "CHATPIPE_CACHE_RETRY_AFTER_S": "1"},
                                  gateway_env={"CHATPIPE_GATEWAY_WORKER_STALE_S": "120"})
        pipeline.redis = redis
        pipeline.turns = Tap(kafka, TURNS)
        yield pipeline
        pipeline.turns.close()
        codes = pipeline.stop()
    assert codes == {"gateway": 0, "inference": 0, "streams": 0}, f"unclean shutdown: {codes}"


def key(tenant: str = "acme") -> str:
    from chatpipe.testing.gateway import API_KEY, OTHER_TENANT_KEY

    return API_KEY if tenant == "acme" else OTHER_TENANT_KEY


def ask(stack, text: str, user: str, *, tenant: str = "acme", conversation: str | None = None,
        headers: dict[str, str] = {}, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0,
            **({"user": user} if tenant == "acme" else {}), **fields}
    answer = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=300,
                        headers={"Authorization": f"Bearer {key(tenant)}",
                                 "X-Chatpipe-Conversation-Id": conversation or f"c-{uuid.uuid4().hex[:12]}",
                                 **headers})
    assert answer.status_code == 200, answer.text
    return answer


def hit(answer: httpx.Response) -> bool:
    return answer.headers.get("x-chatpipe-cache") == "hit"


def turn_of(stack, answer: httpx.Response) -> ConversationTurn:
    request_id = answer.json()["id"].removeprefix("chatcmpl-")
    (turn,) = stack.turns.records(1, timeout_s=60, where=lambda t: getattr(t, "request_id", None) == request_id)
    return turn


def test_a_second_user_of_the_tenant_is_answered_from_the_cache_without_a_worker_and_another_tenant_is_not(stack):
    run = uuid.uuid4().hex[:6]
    question = f"Say the word blue. ({run})"
    first = ask(stack, question, f"ada-{run}")
    assert not hit(first) and turn_of(stack, first).worker_id != CACHE_WORKER
    second = ask(stack, question, f"bob-{run}")
    assert hit(second), "the same context in one tenant: answered from the cache"
    body = second.json()
    assert body["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    assert body["usage"]["prompt_tokens"] == first.json()["usage"]["prompt_tokens"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == body["usage"]["prompt_tokens"]
    turn = turn_of(stack, second)  # recorded as bob's turn, as usual, by no worker
    assert (turn.worker_id, turn.response_cached) == (CACHE_WORKER, True) and turn.user_id.endswith(f":bob-{run}")
    assert not hit(ask(stack, question, "any", tenant="globex")), "another tenant never gets acme's entry"
    assert not hit(ask(stack, question, f"carl-{run}", seed=7)), "another seed is another key"
    tool = {"type": "function", "function": {"name": "colour", "description": "Say a colour",
                                             "parameters": {"type": "object", "properties": {}}}}
    assert not hit(ask(stack, question, f"cid-{run}", tools=[tool])), "other tools: another context and grammar"
    assert not hit(ask(stack, question, f"cyd-{run}", response_format={"type": "json_object"})), \
        "another response_format is another key"
    assert not hit(ask(stack, question, f"dan-{run}", temperature=0.9)), "sampled without a seed: bypassed"
    assert not hit(ask(stack, question, f"eve-{run}", headers={"X-Chatpipe-Cache": "off"})), "opted out"
    assert not hit(ask(stack, question, f"fay-{run}", cache=False)), "opted out in the body (extra_body)"
    assert hit(ask(stack, question, f"gus-{run}")), "the entry is still there for the others"


def test_two_users_whose_memories_differ_do_not_share_an_answer(stack):
    run = uuid.uuid4().hex[:6]
    ada, bob = f"ada-{run}", f"bob-{run}"
    ask(stack, f"Remember: my dog is called Rex{run}.", ada)
    ask(stack, f"Remember: my dog is called Max{run}.", bob)
    question = f"What is my dog called? ({run})"
    assert not hit(ask(stack, question, ada))
    answer = ask(stack, question, bob)
    assert not hit(answer), "bob's context recalls his own dog, not ada's: another key"
    request_id = answer.json()["id"].removeprefix("chatcmpl-")
    requests = Tap(stack.kafka, INFERENCE_REQUESTS)
    try:
        (request,) = requests.records(1, timeout_s=60, where=lambda r: getattr(r, "request_id", None) == request_id)
    finally:
        requests.close()
    context = " ".join(m.content for m in request.messages)
    assert f"Max{run}" in context and f"Rex{run}" not in context, "the premise: the contexts differ by memory"


def test_an_erased_users_entries_are_gone_and_forget_verify_checks_the_cache(stack):
    run = uuid.uuid4().hex[:6]
    ada = f"ada-{run}"
    question = f"Say the word green. ({run})"
    ask(stack, question, ada)
    assert hit(ask(stack, question, f"bob-{run}"))
    from chatpipe.testing.gateway import API_KEY
    from gateway.keys import default_user

    # before the deletion the verifier finds ada's entry (and says it remains: no deletion yet)
    assert cache_line_of(stack, f"{default_user(API_KEY)}:{ada}")[:3] == ["cache", "REMAINS:", "1"]
    gone = httpx.delete(f"{stack.url}/v1/users/{ada}", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert gone.status_code == 202, gone.text
    ada_id = gone.json()["user_id"]  # as stored: a multi-user key's users are namespaced by the key
    deadline = time.monotonic() + 90
    while (line := cache_line_of(stack, ada_id))[:2] != ["cache", "clean"] and time.monotonic() < deadline:
        time.sleep(2)
    assert line[:2] == ["cache", "clean"], line
    assert not hit(ask(stack, question, f"carl-{run}")), "ada's entry is gone"


def cache_line_of(stack, user_id: str) -> list[str]:
    """The words of `chatpipe forget --verify`'s cache line for ``user_id`` of acme."""
    verify = [sys.executable, "-m", "chatpipe.cli", "forget", "--verify", user_id, "--tenant", "acme", "--cache-url",
              stack.redis.url, "--bootstrap-servers", stack.kafka.bootstrap_servers, "--topic-prefix",
              stack.kafka.topic_prefix, "--archive-dir", str(stack.streams.archive_dir), "--memory-path",
              str(stack.streams.memory_dir)]
    out = subprocess.run(verify, cwd=REPO, capture_output=True, text=True, timeout=120)
    line = next((line for line in out.stdout.splitlines() if line.startswith("cache")), "")
    assert line, out.stdout + out.stderr
    return line.split()


def test_redis_killed_requests_are_still_answered_and_redis_back_is_used_again(stack):
    run = uuid.uuid4().hex[:6]
    question = f"Say the word yellow. ({run})"
    stack.redis.kill()
    try:
        assert not hit(ask(stack, question, f"ada-{run}")), "answered by a worker while Redis is away"
    finally:
        stack.redis.start()  # empty: nothing is persisted
    time.sleep(1.5)  # CHATPIPE_CACHE_RETRY_AFTER_S
    ask(stack, question, f"bob-{run}")  # a miss, stored
    assert hit(ask(stack, question, f"carl-{run}")), "Redis is used again"


def test_a_retired_model_versions_entries_are_not_served(stack):
    """Versions do not exist yet (chat.models, issues 41/42): the served model's name is its version, retired
    here with `chatpipe cache retire` as a chat.models follower will when a version leaves live. Last in the
    file: the model stays retired."""
    run = uuid.uuid4().hex[:6]
    question = f"Say the word red. ({run})"
    ask(stack, question, f"ada-{run}")
    assert hit(ask(stack, question, f"bob-{run}"))
    retired = subprocess.run([sys.executable, "-m", "chatpipe.cli", "cache", "retire", MODEL, "--cache-url",
                              stack.redis.url], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert retired.returncode == 0, retired.stderr
    assert not hit(ask(stack, question, f"carl-{run}"))
