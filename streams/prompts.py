"""What intake needs from a PromptRequest: its system prompt, its own history, the new prompt.

A request that decodes but cannot be served raises ``InvalidPromptError`` naming the problem
(it goes to ``chat.dlq`` with that reason). No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.records import ChatMessage, PromptRequest
from streams.errors import InvalidPromptError

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class ParsedPrompt:
    system_prompt: str | None  # the request's system message(s), joined; None = use the default
    history: list[ChatMessage]  # user/assistant messages the client sent before the new prompt
    prompt: str  # the last user message


def parse_prompt(request: PromptRequest) -> ParsedPrompt:
    for name in ("request_id", "conversation_id", "user_id", "tenant"):
        if not getattr(request, name).strip():
            raise InvalidPromptError(f"PromptRequest {request.request_id!r}: empty {name}")
    if not request.messages:
        raise InvalidPromptError(f"PromptRequest {request.request_id}: no messages")
    for i, m in enumerate(request.messages):
        if m.role not in ROLES:
            raise InvalidPromptError(f"PromptRequest {request.request_id}: message {i} has role {m.role!r}, "
                                     f"expected one of {', '.join(ROLES)}")
    last = request.messages[-1]
    if last.role != "user":
        raise InvalidPromptError(f"PromptRequest {request.request_id}: no user message to answer "
                                 f"(the last message is from {last.role!r})")
    if not last.content.strip():
        raise InvalidPromptError(f"PromptRequest {request.request_id}: the user message is empty")
    systems = [m.content for m in request.messages if m.role == "system" and m.content.strip()]
    history = [m for m in request.messages[:-1] if m.role != "system"]
    return ParsedPrompt("\n\n".join(systems) if systems else None, history, last.content)
