"""Context assembly and intake batching bounds: pure logic, no Kafka, no Qdrant.

Run with a trivial word tokenizer (exact arithmetic) and with the chat model's real tokenizer
(the count must be what the inference worker's chat template will produce).
"""

from __future__ import annotations

import pytest

from schemas.records import ChatMessage, PromptRequest, SamplingParams
from streams.batching import split_by_tokens
from streams.context import Segment, assemble_context, priority_order
from streams.errors import InvalidPromptError, PromptTooLongError
from streams.prompts import parse_prompt
from streams.state import ConversationState, PendingRequest, RecentTurn
from streams.tokens import TokenCounter


def words() -> TokenCounter:
    """One token per whitespace-separated word, no template overhead."""
    return TokenCounter(lambda text: text.split())


def turn(i: int, prompt: str | None = None, answer: str | None = None, tid: str | None = None) -> Segment:
    return Segment.turn(prompt or f"question {i}", answer or f"answer {i}", order=i, turn_id=tid or f"t{i}")


def test_everything_fits_in_chronological_order():
    """The model must see system, recalled (as they happened), recent (as they happened), then the prompt."""
    ctx = assemble_context(system_prompt="be brief", prompt="new one", recent=[turn(5), turn(6)],
                           recalled=[turn(2), turn(1)], budget=1000, counter=words())
    assert [m.content for m in ctx.messages] == [
        "be brief", "question 1", "answer 1", "question 2", "answer 2",
        "question 5", "answer 5", "question 6", "answer 6", "new one"]
    assert [m.role for m in ctx.messages][:3] == ["system", "user", "assistant"]
    assert ctx.messages[-1] == ChatMessage("user", "new one")
    assert ctx.recalled_turn_ids == ["t2", "t1"]
    assert ctx.tokens == sum(len(m.content.split()) for m in ctx.messages)


def test_budget_keeps_newest_recent_then_best_recalled_then_older_recent():
    """Guards the relevance order: when space runs out, older recent turns go before recalled ones."""
    # fixed: system (2) + prompt (2) = 4; every turn costs 4 words
    ctx = assemble_context(system_prompt="be brief", prompt="new one", recent=[turn(5), turn(6), turn(7)],
                           recalled=[turn(2), turn(1)], budget=4 + 4 * 3, counter=words())
    kept = [m.content for m in ctx.messages if m.role == "user"]
    assert kept == ["question 1", "question 2", "question 7", "new one"]  # older recent t5, t6 dropped
    assert ctx.recalled_turn_ids == ["t2", "t1"]
    assert ctx.dropped == 2 and ctx.tokens == 16
    tighter = assemble_context(system_prompt="be brief", prompt="new one", recent=[turn(5), turn(6), turn(7)],
                               recalled=[turn(2), turn(1)], budget=4 + 4 * 2, counter=words())
    assert tighter.recalled_turn_ids == ["t2"]  # the best recalled one outlives the second best


def test_a_turn_is_never_split_and_a_smaller_later_one_can_still_fit():
    big = turn(3, prompt="a " * 20)
    ctx = assemble_context(system_prompt="s", prompt="p", recent=[turn(9)], recalled=[big, turn(4)],
                           budget=2 + 4 + 4, counter=words())
    assert "t3" not in ctx.recalled_turn_ids and ctx.recalled_turn_ids == ["t4"]
    assert all(m.content.strip() != "a" for m in ctx.messages)


def test_recalled_turn_already_in_recent_is_not_repeated():
    ctx = assemble_context(system_prompt="s", prompt="p", recent=[turn(1)], recalled=[turn(1)],
                           budget=100, counter=words())
    assert [m.content for m in ctx.messages].count("question 1") == 1
    assert ctx.recalled_turn_ids == []


def test_prompt_larger_than_budget_is_a_named_error():
    with pytest.raises(PromptTooLongError, match="budget of 5"):
        assemble_context(system_prompt="one two", prompt="three four five six", recent=[], recalled=[],
                         budget=5, counter=words())


def test_priority_order_puts_newest_recent_first():
    order = priority_order([turn(1), turn(2), turn(3)], [turn(7)])
    assert [(kind, s.turn_id) for kind, s in order] == [("recent", "t3"), ("recalled", "t7"),
                                                        ("recent", "t2"), ("recent", "t1")]


@pytest.fixture(scope="module")
def chat_counter():
    from inference.engine.model_store import locate_model
    from inference.engine.settings import EngineSettings
    from streams.tokens import load_chat_tokenizer

    tokenizer = load_chat_tokenizer(locate_model(EngineSettings()).folder)
    return tokenizer, TokenCounter.for_tokenizer(tokenizer)


@pytest.mark.model
def test_real_tokenizer_count_is_the_chat_template_length_and_within_budget(chat_counter):
    """context_tokens must be what the worker's chat template makes of the messages, never over budget."""
    tokenizer, counter = chat_counter
    recent = [turn(i, prompt=f"Tell me about topic number {i} in detail.",
                   answer=f"Topic {i} is about many things, " * 5) for i in range(10, 20)]
    recalled = [turn(i, prompt=f"My favourite number is {i}.", answer="Noted.") for i in range(3)]
    for budget in (60, 150, 400, 4000):
        try:
            ctx = assemble_context(system_prompt="You are helpful.", prompt="What is my favourite number?",
                                   recent=recent, recalled=recalled, budget=budget, counter=counter)
        except PromptTooLongError:
            assert budget == 60 or pytest.fail(f"budget {budget} should fit the prompt")
            continue
        templated = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in ctx.messages],
                                                  add_generation_prompt=True, tokenize=False)
        assert ctx.tokens == len(tokenizer.encode(templated, add_special_tokens=False))
        assert ctx.tokens <= budget
    assert ctx.dropped == 0 and len(ctx.recalled_turn_ids) == 3  # the largest budget keeps everything


@pytest.mark.model
def test_real_tokenizer_per_message_estimate_is_close(chat_counter):
    """The additive estimate used to pick segments must track the exact count (within a few tokens)."""
    _, counter = chat_counter
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hello there, how are you?"),
                ChatMessage("assistant", "Fine, thanks!"), ChatMessage("user", "Good.")]
    estimate = counter.prompt_overhead + sum(counter.message_tokens(messages))
    assert abs(estimate - counter.prompt_tokens(messages)) <= 2


# --- batching bounds ----------------------------------------------------------------------------

def test_split_by_tokens_closes_a_batch_before_the_bound_is_passed():
    runs = split_by_tokens(list("abcdef"), [3, 3, 3, 1, 5, 2], max_tokens=6)
    assert runs == [["a", "b"], ["c", "d"], ["e"], ["f"]]


def test_split_by_tokens_keeps_an_oversized_prompt_alone_and_order_intact():
    runs = split_by_tokens(["small", "huge", "small2"], [1, 50, 1], max_tokens=10)
    assert runs == [["small"], ["huge"], ["small2"]]
    assert [x for run in runs for x in run] == ["small", "huge", "small2"]


def test_split_by_tokens_one_batch_when_under_the_bound():
    assert split_by_tokens([1, 2, 3], [1, 1, 1], 100) == [[1, 2, 3]]
    assert split_by_tokens([], [], 5) == []


# --- prompt validation and conversation state ---------------------------------------------------

def request(messages, **kw) -> PromptRequest:
    return PromptRequest(conversation_id="c", user_id="u", tenant="t", model="m", messages=messages,
                         sampling=SamplingParams(max_tokens=8), **kw)


def test_prompt_without_a_final_user_message_is_invalid():
    with pytest.raises(InvalidPromptError, match="no user message"):
        parse_prompt(request([ChatMessage("system", "hi")]))
    with pytest.raises(InvalidPromptError, match="no messages"):
        parse_prompt(request([]))
    with pytest.raises(InvalidPromptError, match="role 'robot'"):
        parse_prompt(request([ChatMessage("robot", "x"), ChatMessage("user", "y")]))


def test_prompt_parts_system_history_and_prompt():
    parsed = parse_prompt(request([ChatMessage("system", "be nice"), ChatMessage("user", "a"),
                                   ChatMessage("assistant", "b"), ChatMessage("user", "c")]))
    assert parsed.system_prompt == "be nice" and parsed.prompt == "c"
    assert [m.content for m in parsed.history] == ["a", "b"]


def test_state_window_dedupe_and_round_trip():
    """The recent window stays bounded, a recorded request id is remembered, the table value round-trips."""
    state = ConversationState("t", "u", "c")
    for i in range(5):
        state.add_pending(PendingRequest(f"r{i}", f"p{i}", None, i), limit=10)
        assert state.take_pending(f"r{i}") is not None
        state.record(f"r{i}", RecentTurn(f"t{i}", i, f"p{i}", f"a{i}", i), tokens_in=1, tokens_out=2,
                     window=3, dedupe_window=4)
    assert [t.turn_id for t in state.recent] == ["t2", "t3", "t4"]
    assert state.was_recorded("r4") and not state.was_recorded("r0")  # r0 fell out of the dedupe window
    assert state.turn_count == 5 and state.tokens_out == 10
    assert ConversationState.from_value(state.to_value()) == state
    assert state.add_pending(PendingRequest("x", "p", None, 0), limit=1) is None
    assert state.add_pending(PendingRequest("y", "p", None, 0), limit=1).request_id == "x"


def test_state_table_value_is_plain_json_dict_same_as_asdict():
    """The table value is built field by field for speed; it must stay exactly what
    ``dataclasses.asdict`` gives (the changelog format older workers restore from), be a copy
    (a later change of the state must not alter a value already handed to the table) and be
    JSON-serialisable."""
    import json
    from dataclasses import asdict

    state = ConversationState("t", "u", "c", turn_count=2, tokens_in=5)
    state.recent.append(RecentTurn("t0", 0, "p", "a", 1))
    state.add_pending(PendingRequest("r1", "p1", "sys", 2), limit=4)
    state.recorded.append("r0")
    value = state.to_value()
    assert value == asdict(state)
    assert json.loads(json.dumps(value)) == value
    state.add_pending(PendingRequest("r2", "p2", None, 3), limit=4)
    state.recent[0].answer = "changed"
    assert [p["request_id"] for p in value["pending"]] == ["r1"] and value["recent"][0]["answer"] == "a"
