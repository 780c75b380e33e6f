"""Memory scoping through the real stack (issue 19, point 1): who may name a user, what each
request recalls, whose requests a key may give feedback on.

Two keys and two users of tenant acme and a key of tenant globex each tell a fact; then every
request's ``InferenceRequest`` (what streams assembled for the model) is read from
``chat.inference.requests``: its ``recalled_turn_ids`` and messages say what it was given, whatever
the tiny model answers. One gateway with its own keys file, on the session's pipeline.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import httpx
import pytest

from chatpipe.testing.gateway import start_gateway
from chatpipe.testing.streams import Tap
from schemas.records import ConversationTurn, InferenceRequest

pytestmark = [pytest.mark.integration, pytest.mark.model]
MODEL = "smollm2-135m-instruct"
RUN = uuid.uuid4().hex[:6]  # users and conversations of this run only: the session's memory holds others
ADA, SHOP = f"ada-{RUN}", f"shop-{RUN}"
KEY_A = f"sk-acme-ada-{RUN}"  # acme, bound to ada
KEY_B = f"sk-acme-app-{RUN}"  # acme, multi-user (an application serving many people)
KEY_C = f"sk-acme-plain-{RUN}"  # acme, plain
KEY_G = f"sk-globex-ada-{RUN}"  # globex, bound to a user of the same name as acme's ada
KEYS = {KEY_A: {"tenant": "acme", "user": ADA}, KEY_B: {"tenant": "acme", "users": "any", "namespace": SHOP},
        KEY_C: {"tenant": "acme"}, KEY_G: {"tenant": "globex", "user": ADA}}


@dataclass
class Told:
    request_id: str
    conversation: str
    turn_id: str


class Scoped:
    def __init__(self, url: str, tap: Tap) -> None:
        self.url, self.tap = url, tap
        self.told: dict[str, Told] = {}

    def post(self, key: str, content: str, *, conversation: str | None = None,
             user: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"}
        if conversation:
            headers["X-Chatpipe-Conversation-Id"] = conversation
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
                "temperature": 0, **({"user": user} if user else {})}
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, headers=headers, timeout=300)

    def ask(self, key: str, content: str, **kw) -> InferenceRequest:
        """What streams gave the model for this request."""
        r = self.post(key, content, **kw)
        assert r.status_code == 200, r.text
        rid = r.headers["X-Chatpipe-Request-Id"]
        return self.tap.records(1, 120, lambda x: isinstance(x, InferenceRequest) and x.request_id == rid)[0]

    def tell(self, key: str, fact: str, **kw) -> Told:
        request = self.ask(key, fact, **kw)
        turn = self.tap.records(1, 120, lambda x: isinstance(x, ConversationTurn)
                                and x.request_id == request.request_id)[0]  # on chat.turns = stored in memory
        return Told(request.request_id, request.conversation_id, turn.event_id)

    def feedback(self, key: str, told: Told, user: str | None = None) -> httpx.Response:
        body = {"request_id": told.request_id, "conversation_id": told.conversation, "kind": "thumbs_down",
                **({"user": user} if user else {})}
        return httpx.post(f"{self.url}/v1/feedback", json=body, headers={"Authorization": f"Bearer {key}"},
                          timeout=30)


def said(request: InferenceRequest, word: str) -> bool:
    return any(word in m.content for m in request.messages)


@pytest.fixture(scope="module")
def scoped(pipeline, tmp_path_factory):
    """A gateway with the four keys, and the facts each told (sequentially, each stored before the next)."""
    root = tmp_path_factory.mktemp("scoping")
    keys = root / "scoping-keys.json"
    keys.write_text(json.dumps(KEYS))
    gateway = start_gateway(pipeline.kafka, root, gateway_id=f"gw-scope-{RUN}", CHATPIPE_GATEWAY_KEYS_FILE=str(keys))
    tap = Tap(pipeline.kafka, "chat.inference.requests", "chat.turns")
    try:
        gateway.wait_healthy(60)
        stack = Scoped(gateway.url, tap)
        stack.told = {
            "ada": stack.tell(KEY_A, "My cat is called Pixel.", conversation=f"a1-{RUN}"),
            "bob": stack.tell(KEY_B, "My dog is called Rex.", conversation=f"b1-{RUN}", user="bob"),
            "nobody": stack.tell(KEY_B, "My bird is called Kiwi.", conversation=f"n1-{RUN}"),
            "globex": stack.tell(KEY_G, "My cat is called Nemo.", conversation=f"g1-{RUN}"),
        }
        yield stack
    finally:
        tap.close()
        assert gateway.terminate() == 0


def test_an_identified_user_recalls_her_facts_across_conversations_and_only_hers(scoped):
    """Acme's ada (bound key) in a new conversation gets her fact from memory, not globex's ada's
    (same user name, same question), and globex's ada gets hers only."""
    acme = scoped.ask(KEY_A, "What is my cat called?", conversation=f"a2-{RUN}")
    assert acme.user_id == ADA and acme.tenant == "acme"
    assert acme.recalled_turn_ids == [scoped.told["ada"].turn_id]
    assert said(acme, "Pixel") and not said(acme, "Nemo")
    globex = scoped.ask(KEY_G, "What is my cat called?", conversation=f"g2-{RUN}")
    assert globex.recalled_turn_ids == [scoped.told["globex"].turn_id]
    assert said(globex, "Nemo") and not said(globex, "Pixel")


def test_a_request_naming_no_user_recalls_only_from_its_own_conversation(scoped):
    """The issue's mix: a key serving many people without `user`; a new conversation must not know
    what another conversation of the key told, while the same conversation keeps its history."""
    new = scoped.ask(KEY_B, "What is my bird called?")  # no user, no conversation id: a new conversation
    assert new.recalled_turn_ids == [] and not said(new, "Kiwi") and not said(new, "Rex")
    same = scoped.ask(KEY_B, "What is my bird called?", conversation=scoped.told["nobody"].conversation)
    assert said(same, "Kiwi") and not said(same, "Rex")  # its own turn, from the conversation's history
    assert set(same.recalled_turn_ids) <= {scoped.told["nobody"].turn_id}


def test_a_multi_user_keys_users_are_namespaced_and_keep_their_memory(scoped):
    bob = scoped.ask(KEY_B, "What is my dog called?", conversation=f"b2-{RUN}", user="bob")
    assert bob.user_id == f"{SHOP}:bob" and bob.recalled_turn_ids == [scoped.told["bob"].turn_id]
    assert said(bob, "Rex") and not said(bob, "Kiwi")
    # "ada" named by the application's key is the application's ada, not the bound key's
    app_ada = scoped.ask(KEY_B, "What is my cat called?", conversation=f"b3-{RUN}", user="ada")
    assert app_ada.user_id == f"{SHOP}:ada" and app_ada.recalled_turn_ids == [] and not said(app_ada, "Pixel")


def test_no_key_acts_for_another_keys_user_or_rates_its_answers(scoped):
    for key, user in [(KEY_C, ADA), (KEY_A, "bob"), (KEY_G, "someone")]:
        r = scoped.post(key, "What is my cat called?", user=user)
        assert r.status_code == 403 and r.json()["error"]["code"] == "user_not_allowed", (key, r.text)
    ada = scoped.told["ada"]
    for key, user in [(KEY_C, None), (KEY_B, None), (KEY_B, "ada"), (KEY_G, None)]:
        r = scoped.feedback(key, ada, user)
        assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found", (key, user, r.text)
    assert scoped.feedback(KEY_A, ada).status_code == 202
    assert scoped.feedback(KEY_B, scoped.told["bob"], "bob").status_code == 202
