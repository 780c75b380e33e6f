"""Context assembly: system prompt + recalled turns + recent turns + the new prompt, within budget.

Pure logic, no I/O: the token counter is injected (``streams.tokens.TokenCounter``). Everything
is kept whole: a turn (user + assistant message) goes in or out as one.

What is kept when not everything fits, most relevant first:

1. the system prompt and the new prompt (always; if they alone do not fit, ``PromptTooLongError``),
2. the newest recent turn (what the new prompt most likely refers to),
3. recalled turns, best recall score first,
4. the other recent turns, newest first.

What the model sees, in order: the system prompt, the kept recalled turns in the order they
happened, the kept recent turns in the order they happened, the new prompt.

The count is exact: candidates are added by summing per-message counts (the template's
overhead per message measured by the counter), then the whole prompt is counted once with the
real template; if merging at message borders made it longer than the budget, the least relevant
kept segment is dropped and the prompt counted again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from schemas.records import ChatMessage
from streams.errors import PromptTooLongError
from streams.tokens import TokenCounter


@dataclass(frozen=True, slots=True)
class Segment:
    """Messages kept or dropped together: a past turn (user + assistant) or one client message."""

    messages: tuple[ChatMessage, ...]
    order: int  # when it happened (epoch ms or turn index): output order
    turn_id: str | None = None  # set for recalled turns: listed in InferenceRequest.recalled_turn_ids

    @classmethod
    def turn(cls, prompt: str, answer: str, order: int, turn_id: str | None = None) -> "Segment":
        return cls((ChatMessage("user", prompt), ChatMessage("assistant", answer)), order, turn_id)


@dataclass(frozen=True, slots=True)
class AssembledContext:
    messages: list[ChatMessage]
    tokens: int  # exact templated prompt length
    recalled_turn_ids: list[str]  # recalled turns that made it into ``messages``
    dropped: int = 0  # optional segments that did not fit


def priority_order(recent: Sequence[Segment], recalled: Sequence[Segment]) -> list[tuple[str, Segment]]:
    """Optional segments, most relevant first (see the module docstring)."""
    newest_first = list(reversed(recent))
    seen = {s.turn_id for s in recent if s.turn_id}
    ordered: list[tuple[str, Segment]] = [("recent", s) for s in newest_first[:1]]
    for s in recalled:
        if s.turn_id is None or s.turn_id not in seen:  # never the same turn twice
            ordered.append(("recalled", s))
            if s.turn_id:
                seen.add(s.turn_id)
    ordered += [("recent", s) for s in newest_first[1:]]
    return ordered


def assemble_context(*, system_prompt: str, prompt: str, recent: Sequence[Segment], recalled: Sequence[Segment],
                     budget: int, counter: TokenCounter) -> AssembledContext:
    """The messages for one request; ``recent`` oldest first, ``recalled`` best first."""
    system, user = ChatMessage("system", system_prompt), ChatMessage("user", prompt)
    fixed = counter.prompt_overhead + sum(counter.message_tokens([system, user]))
    if fixed > budget:
        raise PromptTooLongError(
            f"the system prompt and the prompt take {fixed} tokens, more than the budget of {budget} "
            "(context window minus the request's max_tokens)")
    candidates = priority_order(recent, recalled)
    kept: list[tuple[str, Segment]] = []
    used = fixed
    for kind, segment in candidates:
        cost = sum(counter.message_tokens(segment.messages))
        if used + cost <= budget:
            kept.append((kind, segment))
            used += cost
    while True:
        messages = _render_order(system, user, kept)
        tokens = counter.prompt_tokens(messages)
        if tokens <= budget or not kept:
            break
        kept.pop()  # the least relevant kept segment
    if tokens > budget:
        raise PromptTooLongError(f"the prompt takes {tokens} tokens with the chat template, budget {budget}")
    recalled_ids = [s.turn_id for kind, s in kept if kind == "recalled" and s.turn_id]
    return AssembledContext(messages, tokens, recalled_ids, dropped=len(candidates) - len(kept))


def _render_order(system: ChatMessage, user: ChatMessage, kept: list[tuple[str, Segment]]) -> list[ChatMessage]:
    recalled = sorted((s for kind, s in kept if kind == "recalled"), key=lambda s: s.order)
    recent = sorted((s for kind, s in kept if kind == "recent"), key=lambda s: s.order)
    messages = [system]
    for segment in recalled + recent:
        messages.extend(segment.messages)
    messages.append(user)
    return messages
