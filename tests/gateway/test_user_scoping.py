"""Who a request belongs to and what it may recall, without services: the keys file's user rules
(``resolve_user``), the memory scope the gateway sets, and the request-id MAC that lets only the
key that made a request give feedback on it (issue 19, point 1 and the gateway part of point 2)."""

from __future__ import annotations

import json
import time

import pytest

from gateway.keys import (
    KeysFileError,
    KeyStore,
    Principal,
    owns_request,
    principal_of,
    request_id_for,
    resolve_user,
)
from gateway.openai_api import OpenAIError
from schemas.records import FeedbackKind, MemoryScope
from tests.gateway.test_gateway_units import service_without_kafka

KEYS = {
    "sk-bound": {"tenant": "acme", "user": "ada"},
    "sk-multi": {"tenant": "acme", "users": "any", "namespace": "shop"},
    "sk-multi-default": {"tenant": "acme", "users": "any"},
    "sk-plain": {"tenant": "acme"},
    "sk-globex": "globex",
}


@pytest.fixture()
def keys(tmp_path) -> KeyStore:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    return KeyStore.load(path)


def key(keys: KeyStore, name: str) -> Principal:
    return keys.lookup(f"Bearer {name}")


def test_a_bound_key_acts_for_its_user_only(keys):
    bound = key(keys, "sk-bound")
    assert resolve_user(bound, None) == resolve_user(bound, "") == resolve_user(bound, "ada")
    assert resolve_user(bound, None).user_id == "ada" and resolve_user(bound, None).identified
    with pytest.raises(OpenAIError) as refused:
        resolve_user(bound, "bob")
    error = refused.value
    assert (error.status, error.code, error.param) == (403, "user_not_allowed", "user")
    assert "bound to one user" in error.message


def test_a_multi_user_key_names_users_under_its_namespace(keys):
    multi, default_ns = key(keys, "sk-multi"), key(keys, "sk-multi-default")
    bob = resolve_user(multi, "bob")
    assert (bob.user_id, bob.identified) == ("shop:bob", True)
    # the same name through two keys: two users, never one by accident
    other = resolve_user(default_ns, "bob")
    assert other.user_id.startswith("key-") and other.user_id.endswith(":bob") and other.user_id != bob.user_id
    # naming nobody: the key's default user, not identified (its memory stays in the conversation)
    nobody = resolve_user(multi, None)
    assert nobody.user_id.startswith("key-") and ":" not in nobody.user_id and not nobody.identified
    # naming the key's bound-user-looking name does not reach the bound key's user
    assert resolve_user(multi, "ada").user_id == "shop:ada" != resolve_user(key(keys, "sk-bound"), None).user_id


def test_a_plain_key_names_nobody(keys):
    plain = key(keys, "sk-plain")
    own = resolve_user(plain, None)
    assert own.user_id.startswith("key-") and not own.identified and "sk-plain" not in own.user_id
    with pytest.raises(OpenAIError) as refused:
        resolve_user(plain, "ada")  # another acme key's bound user
    assert (refused.value.status, refused.value.code) == (403, "user_not_allowed")
    assert '"users": "any"' in refused.value.message
    assert resolve_user(key(keys, "sk-globex"), None).identified is False


@pytest.mark.parametrize("entry, problem", [
    ({"tenant": "acme", "users": "some"}, '"users" must be "any"'),
    ({"tenant": "acme", "users": "any", "user": "ada"}, "not both"),
    ({"tenant": "acme", "namespace": "shop"}, "for multi-user keys"),
    ({"tenant": "acme", "users": "any", "namespace": "a:b"}, 'without ":"'),
    ({"tenant": "acme", "user": ""}, "empty"),
])
def test_keys_file_entries_that_say_two_things_are_refused(entry, problem):
    with pytest.raises(KeysFileError, match=problem):
        principal_of("sk-x", entry)


@pytest.mark.parametrize("extra", [
    {"sk-two": {"tenant": "acme", "users": "any", "namespace": "shop"}},  # two keys, one namespace
    {"sk-two": {"tenant": "acme", "user": "shop:bob"}},  # a bound user inside a key's namespace
])
def test_two_keys_that_could_act_for_one_user_are_refused_at_load(tmp_path, extra):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-multi": {"tenant": "acme", "users": "any", "namespace": "shop"}, **extra}))
    with pytest.raises(KeysFileError, match="namespace"):
        KeyStore.load(path)
    # the same namespace in another tenant is another user space: fine
    path.write_text(json.dumps({"sk-multi": {"tenant": "acme", "users": "any", "namespace": "shop"},
                                "sk-two": {"tenant": "globex", "users": "any", "namespace": "shop"}}))
    assert KeyStore.load(path).lookup("Bearer sk-two").namespace == "shop"


def test_the_request_id_mac_names_key_user_and_conversation(keys):
    a, b = key(keys, "sk-bound"), key(keys, "sk-multi")
    rid = request_id_for(a, "ada", "conv-1")
    assert len(rid) == 64 and all(c in "0123456789abcdef" for c in rid)
    assert owns_request(a, rid, "ada", "conv-1")
    assert not owns_request(b, rid, "ada", "conv-1"), "another key of the tenant"
    assert not owns_request(a, rid, "bob", "conv-1") and not owns_request(a, rid, "ada", "conv-2")
    assert not owns_request(a, rid[:32], "ada", "conv-1"), "a bare uuid (no mac)"
    assert not owns_request(a, rid[:-1] + ("0" if rid[-1] != "0" else "1"), "ada", "conv-1")
    # the same key loaded by another gateway instance checks it the same way (no shared store)
    assert owns_request(principal_of("sk-bound", KEYS["sk-bound"]), rid, "ada", "conv-1")
    # fields are length-prefixed: moving characters between user and conversation changes the mac
    assert not owns_request(a, rid, "ad", "aconv-1") and not owns_request(a, rid, "adac", "onv-1")
    assert "mac_secret" not in repr(a)


async def test_the_gateway_scopes_memory_to_the_conversation_unless_the_user_is_identified(keys):
    service = service_without_kafka()
    from tests.gateway.test_gateway_units import completion_request

    cases = [("sk-bound", None, "ada", MemoryScope.USER), ("sk-multi", "bob", "shop:bob", MemoryScope.USER),
             ("sk-multi", None, None, MemoryScope.CONVERSATION), ("sk-plain", None, None, MemoryScope.CONVERSATION)]
    for name, user, user_id, scope in cases:
        body = completion_request()
        body.user = user
        sub = await service.submit(key(keys, name), body, "conv-1", time.perf_counter())
        prompt = service.producer.sent[-1][1]
        assert prompt.memory_scope is scope, (name, user)
        assert prompt.user_id == (user_id or key(keys, name).user_id)
        assert prompt.request_id == sub.request_id and owns_request(key(keys, name), sub.request_id,
                                                                    prompt.user_id, "conv-1")
        service.finish(sub, "ok")
    body = completion_request()
    body.user = "ada"
    with pytest.raises(OpenAIError) as refused:
        await service.submit(key(keys, "sk-plain"), body, "conv-1", time.perf_counter())
    assert refused.value.status == 403 and not service.pending, "a refused request holds no backlog slot"


async def test_feedback_is_taken_for_the_keys_own_requests_only(keys):
    service = service_without_kafka()
    from tests.gateway.test_gateway_units import completion_request

    body = completion_request()
    body.user = "bob"
    sub = await service.submit(key(keys, "sk-multi"), body, "conv-1", time.perf_counter())
    service.finish(sub, "ok")

    def give(name: str, user: str | None = "bob", conversation: str = "conv-1", request_id: str = sub.request_id):
        return service.feedback(key(keys, name), request_id=request_id, conversation_id=conversation,
                                kind=FeedbackKind.THUMBS_DOWN, edited_text=None, comment=None, user=user)

    event_id = await give("sk-multi")
    feedback = service.producer.sent[-1][1]
    assert (feedback.event_id, feedback.user_id, feedback.tenant) == (event_id, "shop:bob", "acme")
    refusals = [("sk-plain", None, "conv-1"),  # another key of the tenant
                ("sk-globex", None, "conv-1"),  # another tenant
                ("sk-multi", "carol", "conv-1"),  # the same key for another of its users
                ("sk-multi", None, "conv-1"),  # ... or for its unnamed default user
                ("sk-multi", "bob", "conv-2")]  # the right user, another conversation
    for name, user, conversation in refusals:
        with pytest.raises(OpenAIError) as refused:
            await give(name, user, conversation)
        assert (refused.value.status, refused.value.code) == (404, "request_not_found"), (name, user, conversation)
    with pytest.raises(OpenAIError) as refused:
        await give("sk-bound", "bob")  # a bound key naming somebody else: refused before the mac
    assert refused.value.status == 403
    with pytest.raises(OpenAIError):
        await give("sk-multi", request_id=sub.request_id[:32])  # an id without its mac
    assert len(service.producer.sent) == 2, "only the prompt and the one accepted feedback were produced"
