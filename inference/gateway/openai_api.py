"""OpenAI's chat-completions shapes: the request body we accept, the objects we answer with, errors.

Only what chatpipe can honour is accepted: ``n`` above 1, tools and audio are refused with
OpenAI's error shape rather than ignored. Unknown fields are ignored, as OpenAI's own server
does for fields a model does not use. What a valid request is (roles, limits, sampling ranges,
``max_tokens`` against the context) is ``schemas.requests``, the definition streams and the
worker check records with too; ``check`` answers its errors as 400s naming the field.

Reference: https://platform.openai.com/docs/api-reference/chat (object names, fields, SSE format).
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.requests import (
    LIMITS,
    OPENAI_ROLES,
    RequestLimits,
    RequestRuleError,
    check_conversation_id,
    check_messages,
    check_metadata,
    check_sampling,
    check_user,
)


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str  # one of schemas.requests.OPENAI_ROLES (ChatCompletionRequest.check)
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[Message]
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Ranges are schemas.requests' (check), so the gateway and the tiers behind it answer alike.
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    user: str | None = None
    metadata: dict[str, str] | None = None
    tools: list[Any] | None = None

    def check(self, context_tokens: int | None = None, limits: RequestLimits = LIMITS) -> None:
        """What pydantic's types cannot say, as OpenAI-shaped 400s: schemas.requests' rules (with
        ``context_tokens``, ``max_tokens`` against the model's context too), then what chatpipe
        does not support."""
        try:
            check_messages([(m.role, m.text()) for m in self.messages], limits, roles=OPENAI_ROLES)
            for name in ("max_tokens", "max_completion_tokens"):
                check_sampling(max_tokens=getattr(self, name), context_tokens=context_tokens, max_tokens_field=name)
            check_sampling(temperature=self.temperature, top_p=self.top_p, seed=self.seed, stop=self.stop_list(),
                           limits=limits)
            if self.user:  # "" = no user, as OpenAI's clients send it
                check_user(self.user, limits)
            if self.metadata is not None:
                check_metadata(self.metadata, limits)
                if "conversation_id" in self.metadata:
                    check_conversation_id(self.metadata["conversation_id"], field="metadata.conversation_id")
        except RequestRuleError as exc:
            raise OpenAIError(400, str(exc), param=exc.field, code=exc.code) from None
        if self.n != 1:
            raise OpenAIError(400, "n must be 1: chatpipe generates one choice per request", param="n",
                              code="unsupported_value")
        if self.tools:
            raise OpenAIError(400, "tools are not supported by chatpipe's models", param="tools",
                              code="unsupported_parameter")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def completion(request_id: str, model: str, text: str, finish_reason: str, tokens_in: int, tokens_out: int,
               created: int | None = None) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": created or int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": finish_reason}],
        "usage": usage(tokens_in, tokens_out),
    }


def usage(tokens_in: int, tokens_out: int) -> dict[str, int]:
    return {"prompt_tokens": tokens_in, "completion_tokens": tokens_out, "total_tokens": tokens_in + tokens_out}


def chunk(request_id: str, model: str, created: int, *, delta: dict[str, Any] | None = None,
          finish_reason: str | None = None, usage_: dict[str, int] | None = None, final_usage: bool = False) -> str:
    """One SSE event of a streamed completion (``chat.completion.chunk``)."""
    body: dict[str, Any] = {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk", "created": created,
                            "model": model}
    if final_usage:  # OpenAI's usage chunk: no choices, usage only (stream_options.include_usage)
        body["choices"] = []
        body["usage"] = usage_
    else:
        body["choices"] = [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish_reason}]
    return sse(body)


def sse(body: dict[str, Any] | str) -> str:
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


# Engine finish reasons (schemas.records.FinishReason) -> OpenAI's.
FINISH = {"STOP": "stop", "LENGTH": "length", "CANCELLED": "stop", "TIMEOUT": "length", "ERROR": "stop",
          "OVERLOADED": "stop"}


def error_for_chunk(error_code: str | None, error: str | None) -> OpenAIError:
    """The HTTP error for a final chunk that says the request was not served."""
    message = error or "the request was not served"
    if error_code == "context_length_exceeded":
        return OpenAIError(400, f"This request exceeds the model's context: {message}. Please reduce the length "
                                "of the messages or max_tokens.", param="messages", code="context_length_exceeded")
    if error_code == "invalid_request":
        return OpenAIError(400, message, param="messages", code="invalid_value")
    if error_code == "expired":  # a tier took it after its deadline (the gateway's own 504 time)
        return OpenAIError(504, f"the request passed its deadline before it was served: {message}",
                           type="server_error", code="expired")
    if error_code == "cancelled":
        return OpenAIError(503, f"the generation was cancelled: {message}", type="server_error", code="cancelled")
    return OpenAIError(500, message, type="server_error", code=error_code or "internal_error")
