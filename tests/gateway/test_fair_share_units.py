"""The gateway's part of the fair share (issue 40 item 2), in this process: a key's tenant weight from the keys
file onto the PromptRequest, OpenAI's ``service_tier`` onto the priority classes and back into the answer, flex
refused when there is no room soon; and the records that carry the weight (PromptRequest v6 ->
InferenceRequest v4) with its rule. The engine's side is tests/engine/test_fair_queue.py; the two-tenant figures
are bench/load.py --tenants."""

from __future__ import annotations

import json

import pytest

from transport.fleet import Work
from gateway.keys import KeysFileError, KeyStore
from gateway.openai_api import SERVICE_TIERS, ChatCompletionRequest, OpenAIError, service_tier_served
from gateway.responses import chunk, completion
from gateway.settings import GatewaySettings
from gateway.translate import chat_request_to_prompt
from schemas.codec import default_codec
from schemas.records import ChatMessage, InferenceRequest, Priority, PromptRequest, SamplingParams
from schemas.requests import RequestRuleError, check_prompt_request
from tests.gateway.test_admission_units import MODEL, admission, prompt, status, warm_fleet
from tests.schemas.test_sampling_records import older

codec = default_codec()


def store(tmp_path, entries: dict) -> KeyStore:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(entries))
    return KeyStore.load(path)


def test_a_tenants_weight_comes_from_any_of_its_keys_and_defaults_to_one(tmp_path):
    keys = store(tmp_path, {"sk-a1": {"tenant": "a", "weight": 3}, "sk-a2": {"tenant": "a", "user": "ada"},
                            "sk-b": "b"})
    assert keys.lookup("Bearer sk-a1").share_weight == 3.0
    assert keys.lookup("Bearer sk-a2").share_weight == 3.0  # the tenant's, though this key does not say it
    assert keys.lookup("Bearer sk-b").share_weight == 1.0


@pytest.mark.parametrize("entries, says", [
    ({"sk-a1": {"tenant": "a", "weight": 2}, "sk-a2": {"tenant": "a", "weight": 3}}, "different weights"),
    ({"sk-a": {"tenant": "a", "weight": 0}}, '"weight"'),
    ({"sk-a": {"tenant": "a", "weight": "high"}}, '"weight"'),
    ({"sk-a": {"tenant": "a", "weight": True}}, '"weight"'),
    ({"sk-a": {"tenant": "a", "weight": 10_000}}, "at most"),
])
def test_bad_weights_are_named_errors_at_load(tmp_path, entries, says):
    """Guards against a keys file whose weights silently mean nothing (or something else) at the workers."""
    with pytest.raises(KeysFileError, match=says):
        store(tmp_path, entries)


def test_the_weight_and_the_tier_reach_the_prompt_request(tmp_path):
    principal = store(tmp_path, {"sk-a": {"tenant": "a", "weight": 2.5}}).lookup("Bearer sk-a")
    settings = GatewaySettings()
    for tier, priority in (("flex", Priority.BATCH), ("priority", Priority.INTERACTIVE), (None, Priority.INTERACTIVE)):
        body = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}], service_tier=tier)
        record = chat_request_to_prompt(body, principal, settings, conversation_id=None, reply_to="r")
        assert (record.priority, record.share_weight) == (priority, 2.5)


def test_openais_tiers_map_onto_the_classes_and_the_answer_names_the_one_that_served():
    assert set(SERVICE_TIERS) == {None, "auto", "default", "flex", "priority"}
    assert service_tier_served(SERVICE_TIERS["flex"]) == "flex"
    for tier in (None, "auto", "default", "priority"):  # no class above interactive: served as default
        assert service_tier_served(SERVICE_TIERS[tier]) == "default"
    with pytest.raises(OpenAIError) as refused:
        ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}], service_tier="scale").check()
    assert refused.value.status == 400 and refused.value.param == "service_tier"
    assert completion("r", MODEL, [], 1, 1, 0, "flex")["service_tier"] == "flex"
    assert '"service_tier":"flex"' in chunk("r", MODEL, 0, delta={"content": "x"}, service_tier="flex")


def test_flex_is_refused_when_no_batch_slot_comes_soon_and_default_is_not():
    """Guards against flex queueing behind everything until its deadline (OpenAI's flex answers 429 instead)."""
    fleet, _ = warm_fleet(status(running=8, waiting=10, max_running=8, queued_output=650, running_output=400,
                                 decode=50.0))  # a slot in (650 + 400) / 50 = 21 s
    gate = admission(fleet, flex_max_wait_s=10)
    flex = prompt(timeout_s=300)
    flex.priority = Priority.BATCH
    with pytest.raises(OpenAIError) as refused:
        gate.check(flex, 0, 0, Work())
    error = refused.value
    assert error.status == 429 and error.code == "flex_capacity_unavailable"
    assert int(error.headers["Retry-After"]) == 11  # 21 - 10 s
    gate.check(prompt(timeout_s=300), 0, 0, Work())  # default: 21 s fits its 300 s
    admission(fleet, flex_max_wait_s=30).check(flex, 0, 0, Work())  # flex with room enough


def test_the_weight_round_trips_and_older_versions_read_as_weight_one():
    record = PromptRequest(conversation_id="c", user_id="u", tenant="a", model=MODEL,
                           messages=[ChatMessage("user", "hi")], share_weight=2.5)
    assert codec.decode(codec.encode(record)).share_weight == 2.5
    assert codec.decode(older(record, "PromptRequest", 5)).share_weight == 1.0
    request = InferenceRequest(request_id="r", conversation_id="c", user_id="u", tenant="a", created_at=1, model=MODEL,
                               messages=[ChatMessage("user", "hi")], sampling=SamplingParams(), share_weight=0.5)
    assert codec.decode(codec.encode(request)).share_weight == 0.5
    assert codec.decode(older(request, "InferenceRequest", 3)).share_weight == 1.0


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf"), 1001.0])
def test_a_prompt_with_a_bad_weight_breaks_a_rule(weight):
    """Guards against a producer's record that would divide by zero or hold a batch for good at the worker:
    streams dead-letters it with this reason (check_prompt_request is its parse)."""
    record = PromptRequest(conversation_id="c", user_id="u", tenant="a", model=MODEL,
                           messages=[ChatMessage("user", "hi")], share_weight=weight)
    with pytest.raises(RequestRuleError) as broken:
        check_prompt_request(record)
    assert broken.value.field == "share_weight"
