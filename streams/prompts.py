"""What intake needs from a PromptRequest: its system prompt, its own history, the new prompt.

A request that decodes but cannot be served raises ``InvalidPromptError`` naming the problem
(it goes to ``chat.dlq`` with that reason, and its asker gets an error final chunk). What
"cannot be served" means is ``schemas.requests``, the one definition the gateway checks HTTP
bodies with: a record produced straight to Kafka meets the same rules. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.records import ChatMessage, PromptRequest
from schemas.requests import ROLES, RequestRuleError, check_prompt_request
from streams.errors import InvalidPromptError

__all__ = ["ROLES", "ParsedPrompt", "parse_prompt"]


@dataclass(frozen=True, slots=True)
class ParsedPrompt:
    system_prompt: str | None  # the request's system message(s), joined; None = use the default
    history: list[ChatMessage]  # user/assistant messages the client sent before the new prompt
    prompt: str  # the last user message; a raw prompt's whole text
    raw: bool = False  # PromptRequest v5 raw_prompt: no chat template, no memory (intake.py)


def parse_prompt(request: PromptRequest, context_tokens: int | None = None) -> ParsedPrompt:
    """With ``context_tokens`` (the settings' context size), a ``max_tokens`` that leaves the prompt
    no room is refused here, naming the limit, instead of as a negative context budget."""
    try:
        check_prompt_request(request, context_tokens=context_tokens)
    except RequestRuleError as exc:
        raise InvalidPromptError(f"PromptRequest {request.request_id!r}: {exc}") from None
    if request.raw_prompt is not None:
        return ParsedPrompt(None, [], request.raw_prompt, raw=True)
    last = request.messages[-1]
    systems = [m.content for m in request.messages if m.role == "system" and m.content.strip()]
    history = [m for m in request.messages[:-1] if m.role != "system"]
    return ParsedPrompt("\n\n".join(systems) if systems else None, history, last.content)
