"""The gateway's DELETE routes (gateway/erasure.py) on a bare FastAPI app: who may erase
whom (the same rules as a chat request's ``user``), the Deletion each produces and its key, and the
OpenAI-shaped errors. The producer is a stand-in that keeps what it was given; the whole path through
the real stack is tests/gateway/test_erasure_canary.py."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Header
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from gateway.erasure import add_erasure_routes
from gateway.keys import Principal
from gateway.openai_api import OpenAIError
from schemas.records import Deletion, DeletionScope
from transport.errors import DeliveryError
from transport.settings import KafkaSettings

KEYS = {
    "sk-bound": Principal("acme", "ada", bound=True),
    "sk-multi": Principal("acme", "key-multi", multi_user=True, namespace="shop"),
    "sk-plain": Principal("acme", "key-plain"),
}


class FakeProducer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Deletion, bytes]] = []
        self.fail = False

    async def send(self, topic, record, *, key):
        if self.fail:
            raise DeliveryError("broker away")
        self.sent.append((topic, record, key))


class FakeService:
    def __init__(self) -> None:
        self.kafka = KafkaSettings(topic_prefix="p.")
        self.producer = FakeProducer()


@pytest.fixture
def client_and_service():
    app = FastAPI()
    service = FakeService()

    @app.exception_handler(OpenAIError)
    async def openai_error(_, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    def authenticate(authorization: str | None = Header(None)) -> Principal:
        principal = KEYS.get((authorization or "").removeprefix("Bearer "))
        if principal is None:
            raise OpenAIError(401, "bad key", code="invalid_api_key")
        return principal

    add_erasure_routes(app, authenticate, service)
    return TestClient(app), service


def delete(client, path, key):
    return client.delete(path, headers={"Authorization": f"Bearer {key}"})


def test_a_bound_key_erases_its_user_and_nobody_else(client_and_service):
    client, service = client_and_service
    answer = delete(client, "/v1/users/ada", "sk-bound")
    assert answer.status_code == 202, answer.text
    (topic, deletion, key), = service.producer.sent
    assert topic == "p.chat.deletions" and key == b"acme/ada"
    assert (deletion.scope, deletion.tenant, deletion.user_id, deletion.conversation_id) == \
        (DeletionScope.USER, "acme", "ada", None)
    assert answer.json()["event_id"] == deletion.event_id and answer.json()["object"] == "deletion"
    refused = delete(client, "/v1/users/bob", "sk-bound")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "user_not_allowed"
    assert len(service.producer.sent) == 1, "a refused erasure produces nothing"


def test_a_multi_user_key_erases_its_namespaced_users_and_one_conversation(client_and_service):
    client, service = client_and_service
    answer = delete(client, "/v1/users/bob/conversations/chat-7", "sk-multi")
    assert answer.status_code == 202, answer.text
    (_, deletion, key), = service.producer.sent
    assert key == b"acme/shop:bob" and answer.json()["user_id"] == "shop:bob"
    assert (deletion.scope, deletion.user_id, deletion.conversation_id) == (DeletionScope.CONVERSATION, "shop:bob",
                                                                             "chat-7")


def test_a_plain_key_names_nobody_but_erases_its_own_conversations(client_and_service):
    client, service = client_and_service
    refused = delete(client, "/v1/users/ada", "sk-plain")
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
    answer = delete(client, "/v1/conversations/chat-1", "sk-plain")
    assert answer.status_code == 202
    (_, deletion, key), = service.producer.sent
    assert key == b"acme/key-plain" and deletion.conversation_id == "chat-1" and deletion.user_id == "key-plain"


def test_bad_input_and_a_broker_away_are_openai_errors(client_and_service):
    client, service = client_and_service
    bad = delete(client, "/v1/conversations/has space", "sk-plain")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "conversation_id"
    long = delete(client, "/v1/users/" + "u" * 300, "sk-multi")
    assert long.status_code == 400 and "at most" in long.json()["error"]["message"]
    assert delete(client, "/v1/users/ada", "sk-nope").status_code == 401
    service.producer.fail = True
    away = delete(client, "/v1/users/ada", "sk-bound")
    assert away.status_code == 503 and "nothing will be erased" in away.json()["error"]["message"]
    assert not service.producer.sent
