"""Pieces of the gateway that need no services: the keys file, and how a retried answer is shown."""

from __future__ import annotations

import json

import pytest

from inference.gateway.keys import KeysFileError, KeyStore
from inference.gateway.replies import Reply
from inference.gateway.service import AnswerText
from schemas.records import TokenChunk


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
    shown = [answer.feed(Reply(chunk(i, t), "a1")) for i, t in enumerate(["Hel", "lo", " you"])]
    assert shown == ["Hel", "lo", " you"]
    assert answer.feed(Reply(chunk(1, "lo"), "a1")) is None  # a duplicate delivery


def test_a_retried_attempt_continues_where_the_client_is_and_the_dead_one_is_ignored():
    """A worker died after streaming 'Hello'; the retry streams 'Hello world' from index 0: the
    client must see 'Hello world' once, and late chunks of the dead attempt must not interleave."""
    answer = AnswerText()
    assert answer.feed(Reply(chunk(0, "Hel"), "dead")) == "Hel"
    assert answer.feed(Reply(chunk(1, "lo"), "dead")) == "lo"
    retry = [answer.feed(Reply(chunk(i, t, final=(i == 2)), "retry")) for i, t in enumerate(["He", "llo w", "orld"])]
    assert retry == ["", " w", "orld"]
    assert answer.feed(Reply(chunk(2, " there"), "dead")) is None


def test_the_gateway_serves_the_model_name_the_worker_answers_under():
    """The gateway keeps its own copy of the default model's name (it does not import the engine):
    a rename on one side only would make every request a 404 model_not_found."""
    from inference.engine.settings import DEFAULT_MODEL_NAME
    from inference.gateway.settings import DEFAULT_MODEL, GatewaySettings

    assert DEFAULT_MODEL == DEFAULT_MODEL_NAME
    assert GatewaySettings().models == [DEFAULT_MODEL_NAME]
