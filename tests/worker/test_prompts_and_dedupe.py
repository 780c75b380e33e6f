"""Request preparation (chat template, named rejections) and the reader-side dedupe helpers."""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import pytest

from chatpipe.testing.kafka import StreamAssembler
from inference.worker.errors import InvalidRequestError, InvalidSamplingError, PromptTooLongError
from inference.worker.prompts import prepare
from schemas.records import ChatMessage, InferenceRequest, SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    """The real default model's tokenizer (its chat template included; `chatpipe model pull`)."""
    from transformers import AutoTokenizer

    from inference.engine.settings import EngineSettings

    return AutoTokenizer.from_pretrained(EngineSettings().default_model_dir(), local_files_only=True)


def request(messages=None, **sampling) -> InferenceRequest:
    return InferenceRequest(request_id="r", conversation_id="c", user_id="u", tenant="t", created_at=0, model="m",
                            messages=[ChatMessage("user", "hi")] if messages is None else messages, sampling=SamplingParams(**sampling))


@pytest.mark.model
def test_prompt_goes_through_the_chat_template(tokenizer):
    prepared = prepare(request([ChatMessage("system", "be brief"), ChatMessage("user", "hi")]), tokenizer, 2048)
    text = tokenizer.decode(prepared.prompt_ids)
    assert "be brief" in text and text.rstrip().endswith("assistant")


@pytest.mark.model
@pytest.mark.parametrize("sampling", [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5),
                                      dict(top_k=-2), dict(temperature=float("nan"))])
def test_invalid_sampling_is_a_named_error(tokenizer, sampling):
    with pytest.raises(InvalidSamplingError):
        prepare(request(**sampling), tokenizer, 2048)


@pytest.mark.model
def test_too_long_names_the_counts_and_the_limit(tokenizer):
    with pytest.raises(PromptTooLongError, match=r"tokens \+ max_tokens 100 = \d+ tokens exceeds .* 64 tokens"):
        prepare(request([ChatMessage("user", "word " * 50)], max_tokens=100), tokenizer, 64)


@pytest.mark.model
def test_no_messages_or_unknown_role_is_rejected(tokenizer):
    with pytest.raises(InvalidRequestError):
        prepare(request(messages=[]), tokenizer, 2048)
    with pytest.raises(InvalidRequestError, match="robot"):
        prepare(request([ChatMessage("robot", "x")]), tokenizer, 2048)


@pytest.mark.model
def test_the_tenants_weight_reaches_the_engine_and_a_bad_one_is_the_records_fault(tokenizer):
    """Guards against a weight lost between the record and the engine's fair share (every tenant weight 1),
    and against a record produced straight to chat.inference.requests with weight 0 (a division by zero in
    the fair queue): it is dead-lettered as invalid."""
    req = request()
    req.share_weight = 2.5
    assert prepare(req, tokenizer, 2048).share_weight == 2.5
    req.share_weight = 0.0
    with pytest.raises(InvalidRequestError, match="share_weight"):
        prepare(req, tokenizer, 2048)


# A template of the kind many models ship (Llama 2, Mistral, Gemma): roles must alternate, or it raises.
ALTERNATING_TEMPLATE = (
    "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def alternating_tokenizer(tokenizer):
    """The real tokenizer with a chat template that refuses two messages of one role in a row."""
    import copy

    strict = copy.deepcopy(tokenizer)
    strict.chat_template = ALTERNATING_TEMPLATE
    return strict


@pytest.mark.model
def test_a_chat_template_that_refuses_the_messages_is_the_requests_fault(alternating_tokenizer):
    """A template's raise_exception used to escape the worker as an unclassified exception: the worker
    exited, and the request crash-looped it. It is the request's fault: a named InvalidRequestError
    (answered with an error chunk and dead-lettered), not a crash."""
    from transport.failures import Fault, classify

    two_users = [ChatMessage("user", "hi"), ChatMessage("user", "hello again")]
    with pytest.raises(InvalidRequestError, match="roles must alternate") as caught:
        prepare(request(two_users), alternating_tokenizer, 2048)
    assert classify(caught.value) is Fault.RECORD
    prepared = prepare(request([ChatMessage("user", "hi")]), alternating_tokenizer, 2048)  # others still served
    assert prepared.prompt_ids


def chunk(rid, index, text, final=False):
    return SimpleNamespace(request_id=rid, index=index, text=text, is_final=final)


def test_stream_assembler_keeps_attempts_apart_and_waits_for_the_final_chunk():
    """Guards against a reader mixing the chunks of a crashed attempt with those of the retry."""
    asm = StreamAssembler()
    asm.add(chunk("r", 0, "Hel"), "a1")
    asm.add(chunk("r", 1, "lo"), "a1")  # attempt a1 died here
    asm.add(chunk("r", 0, "Hi"), "a2")
    assert asm.text("r", "a2") is None  # not final yet
    asm.add(chunk("r", 1, " there", final=True), "a2")
    asm.add(chunk("r", 1, " there", final=True), "a2")  # a duplicate delivery is harmless
    assert asm.text("r", "a2") == "Hi there"
    assert asm.text("r", "a1") is None


class FirstSeen:
    """Bounded memory of ids: ``add`` is True the first time an id is seen (LRU beyond capacity): how a
    reader that sees every Response keeps the first of each request (docs/worker.md "Delivery")."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str) -> bool:
        if key in self._ids:
            self._ids.move_to_end(key)
            return False
        self._ids[key] = None
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
        return True

    def __contains__(self, key: str) -> bool:
        return key in self._ids


def test_first_seen_is_bounded():
    seen = FirstSeen(capacity=2)
    assert seen.add("a") and not seen.add("a")
    seen.add("b")
    seen.add("c")
    assert "a" not in seen and seen.add("a")
