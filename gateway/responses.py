"""The way back: a request's ``TokenChunk``s -> OpenAI's answer objects (the second direction).

The forward way, a request body -> its record, is ``gateway/translate.py``; nothing here is called
from it, and nothing here calls it.

- chat completions: a ``chat.completion`` (``completion``, ``choice``), a streamed
  ``chat.completion.chunk`` (``chunk``, ``sse``), ``usage``, the logprobs objects; the engine's finish
  reasons in OpenAI's words (``FINISH``); a final chunk that says the request was not served as the
  HTTP error (``error_for_chunk``);
- tool calls: ``ToolCallStream`` reads one choice's output (streamed or whole) into OpenAI's deltas:
  content pieces, then per call its header (index, ``call_...`` id, type, function name,
  ``arguments: ""``) and the arguments' text in pieces as they come (the text convention the model
  writes is ``gateway/tools.py``'s, the grammar's); ``finish_reason`` says ``tool_calls`` after
  complete calls; ``reads_tool_calls`` says from a record whether its answer is read for calls.

The legacy ``text_completion`` objects of POST /v1/completions are ``gateway/completions.py``'s;
which chunks reach a request, and in what order, is ``GatewayService.replies`` (``service.py``).

Reference: https://platform.openai.com/docs/api-reference/chat (object names, fields, SSE format).
"""

from __future__ import annotations

import json
import math
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from formats.response_format import TOOL_CALL_TRIGGER
from gateway.openai_api import OpenAIError
from schemas.requests import TOOL_CALLS_FORMAT

_ID_CHARS = string.ascii_letters + string.digits
# What the model writes after <tool_call> up to the arguments (the grammar writes it exactly so;
# whitespace is free in ``auto`` mode, hence the \s*).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_TAIL = re.compile(r"\s*\}\s*</tool_call>")
_MAX_HEAD_CHARS = 256  # a head that is not a call by then is text


# -- chat completions -------------------------------------------------------------------------------

def completion(request_id: str, model: str, choices: list[dict[str, Any]], tokens_in: int, tokens_out: int,
               created: int, service_tier: str = "default", cached_tokens: int = 0) -> dict[str, Any]:
    """A ``chat.completion``; ``choices`` from ``choice`` (index order); ``service_tier``: the tier
    that served it (``openai_api.service_tier_served``); ``cached_tokens``: ``usage``'s."""
    return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": created, "model": model,
            "service_tier": service_tier, "choices": choices, "usage": usage(tokens_in, tokens_out, cached_tokens)}


def choice(index: int, text: str | None, finish_reason: str, logprobs: list[Any] | None = None,
           tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One choice of a ``chat.completion``; ``logprobs``: the choice's ``TokenLogprob`` records, or
    None when the request did not ask for them (OpenAI's ``logprobs: null``); ``tool_calls``: the
    calls the answer made (``message.tool_calls``; ``content`` is None then unless text came too)."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs_object(logprobs), "finish_reason": finish_reason}


def logprobs_object(entries: list[Any] | None) -> dict[str, Any] | None:
    """OpenAI's ``logprobs`` of a choice or chunk from ``schemas.records.TokenLogprob``s."""
    if entries is None:
        return None
    return {"content": [{**_token(e), "top_logprobs": [_token(t) for t in e.top]} for e in entries],
            "refusal": None}


def _token(entry: Any) -> dict[str, Any]:
    return {"token": entry.token, "logprob": json_logprob(entry.logprob), "bytes": list(entry.bytes)}


def json_logprob(value: float) -> float:
    # JSON has no -inf: OpenAI answers -9999.0 for a token the model gives no chance
    return value if math.isfinite(value) else -9999.0


def usage(tokens_in: int, tokens_out: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's ``usage``. ``prompt_tokens_details.cached_tokens``: of the prompt tokens, those the
    engine took from its prefix cache (the final chunk's ``cached_tokens``; every one on an answer from
    streams' response cache); always present, 0 when none, as OpenAI sends it."""
    return {"prompt_tokens": tokens_in, "completion_tokens": tokens_out, "total_tokens": tokens_in + tokens_out,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chunk(request_id: str, model: str, created: int, *, index: int = 0, delta: dict[str, Any] | None = None,
          logprobs: list[Any] | None = None, finish_reason: str | None = None,
          usage_: dict[str, Any] | None = None, service_tier: str = "default") -> str:
    """One SSE event of a streamed completion (``chat.completion.chunk``) for choice ``index``;
    ``logprobs``: the ``TokenLogprob``s of this event's tokens (None: not asked)."""
    body: dict[str, Any] = {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk", "created": created,
                            "model": model, "service_tier": service_tier}
    if usage_ is not None:  # OpenAI's usage chunk: no choices, usage only (stream_options.include_usage)
        body["choices"] = []
        body["usage"] = usage_
    else:
        body["choices"] = [{"index": index, "delta": delta or {}, "logprobs": logprobs_object(logprobs),
                            "finish_reason": finish_reason}]
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
    if error_code == "invalid_request":  # a tier's rule; a schema only a worker could compile names its part
        param = "tools" if message.startswith("response_format.tool_calls") else \
            "response_format" if message.startswith("response_format") else "messages"
        return OpenAIError(400, message, param=param, code="invalid_value")
    if error_code == "expired":  # a tier took it after its deadline (the gateway's own 504 time)
        return OpenAIError(504, f"the request passed its deadline before it was served: {message}",
                           type="server_error", code="expired")
    if error_code == "cancelled":
        return OpenAIError(503, f"the generation was cancelled: {message}", type="server_error", code="cancelled")
    return OpenAIError(500, message, type="server_error", code=error_code or "internal_error")


def reader_stopped_error(cause: BaseException) -> OpenAIError:
    """The 503 of a gateway whose reply reader stopped: another gateway, or this one restarted, answers."""
    return OpenAIError(503, f"this gateway cannot read answers any more ({cause}) and is restarting; retry",
                       type="server_error", code="gateway_unavailable", headers={"Retry-After": "5"})


# -- tool calls -------------------------------------------------------------------------------------

def reads_tool_calls(response_format: str | None) -> bool:
    """Whether a record's answer is read for tool calls: its ``sampling.response_format`` (JSON text)
    is the tool-call constraint (``tool_choice`` auto, required or a named function). The gateway wrote
    that text itself (``schemas.requests.response_format_text``: an object with its ``type``)."""
    return bool(response_format) and json.loads(response_format)["type"] == TOOL_CALLS_FORMAT


@dataclass
class Call:
    index: int
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    complete: bool = False

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": "".join(self.arguments)}}


class ToolCallStream:
    """Reads one choice's output, in increments, into OpenAI's delta objects (``feed`` / ``end``):
    ``{"content": ...}`` for text, ``{"tool_calls": [{"index", "id", "type", "function": {"name",
    "arguments": ""}}]}`` when a call's name is known, then ``{"tool_calls": [{"index", "function":
    {"arguments": piece}}]}``. Text that could be the start of ``<tool_call>`` is held back until it
    is known; whitespace-only text around calls is dropped (the answer's content is null then)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.content: list[str] = []
        self._state = "text"  # text | head | args | tail
        self._buf = ""
        self._ws = ""  # whitespace held back in text (dropped if a call follows)
        self._depth = 0
        self._in_string = False
        self._escape = False

    @property
    def text(self) -> str | None:
        return "".join(self.content) or None

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._buf += text
        out: list[dict[str, Any]] = []
        step = {"text": self._text, "head": self._head, "args": self._args, "tail": self._tail}
        while self._buf and step[self._state](out):
            pass
        return out

    def end(self) -> list[dict[str, Any]]:
        """What is left once the output ended: held-back text, a call's head that never became one.
        Trailing whitespace is dropped."""
        out: list[dict[str, Any]] = []
        if self._state == "head":
            self._buf = TOOL_CALL_TRIGGER + self._buf
        if self._state in ("text", "head"):
            self._emit_text(self._buf, out)
        self._buf, self._ws = "", ""
        return out

    def _emit_text(self, text: str, out: list[dict[str, Any]]) -> None:
        """Text outside calls; whitespace at its ends held back (a call or the end may follow)."""
        body = text.rstrip()
        if not body.strip():
            self._ws += text
            return
        lead = self._ws if self.content else ""
        if not self.content:
            body = body.lstrip()
        self._ws = text[len(text.rstrip()):]
        piece = lead + body
        self.content.append(piece)
        out.append({"content": piece})

    def _text(self, out: list[dict[str, Any]]) -> bool:
        at = self._buf.find(TOOL_CALL_TRIGGER)
        if at >= 0:
            self._emit_text(self._buf[:at], out)
            self._ws = ""  # whitespace before a call is not content
            self._buf = self._buf[at + len(TOOL_CALL_TRIGGER):]
            self._state = "head"
            return True
        keep = _partial_suffix(self._buf, TOOL_CALL_TRIGGER)
        emit, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        self._emit_text(emit, out)
        return False

    def _head(self, out: list[dict[str, Any]]) -> bool:
        match = _HEAD.match(self._buf)
        if match is None:
            if len(self._buf) > _MAX_HEAD_CHARS:  # not a call after all: text
                self._state, text, self._buf = "text", TOOL_CALL_TRIGGER + self._buf, ""
                self._emit_text(text, out)
            return False
        try:
            name = json.loads(match.group(1))
        except ValueError:
            name = match.group(1).strip('"')
        call = Call(len(self.calls), "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24)), name)
        self.calls.append(call)
        out.append({"tool_calls": [{"index": call.index, **call.openai()}]})  # its arguments: "" so far
        self._buf = self._buf[match.end():]
        self._state, self._depth, self._in_string, self._escape = "args", 0, False, False
        return True

    def _args(self, out: list[dict[str, Any]]) -> bool:
        call = self.calls[-1]
        if self._depth == 0:  # whitespace before the arguments' object is not part of them
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
        end = None
        for i, ch in enumerate(self._buf):
            if self._escape:
                self._escape = False
            elif self._in_string:
                if ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        piece = self._buf if end is None else self._buf[:end]
        if piece:
            call.arguments.append(piece)
            out.append({"tool_calls": [{"index": call.index, "function": {"arguments": piece}}]})
        self._buf = "" if end is None else self._buf[end:]
        if end is None:
            return False
        self._state = "tail"
        return True

    def _tail(self, out: list[dict[str, Any]]) -> bool:
        match = _TAIL.match(self._buf)
        if match is None and _could_be_tail(self._buf):
            return False  # more may close the call
        # Closed as written, or not (then the rest is taken as text): the call ended either way.
        self.calls[-1].complete = True
        self._buf = self._buf if match is None else self._buf[match.end():]
        self._state = "text"
        return True


def _partial_suffix(text: str, token: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``token``."""
    return next((n for n in range(min(len(text), len(token) - 1), 0, -1) if token.startswith(text[-n:])), 0)


def _could_be_tail(text: str) -> bool:
    stripped = text.lstrip()
    if not stripped:
        return True
    if not stripped.startswith("}"):
        return False
    rest = stripped[1:].lstrip()
    return "</tool_call>".startswith(rest) or rest.startswith("</tool_call>")


def finish_reason(stream: ToolCallStream, engine_finish: str) -> str:
    """OpenAI's ``tool_calls`` when the model stopped after calling; else the engine's reason."""
    if engine_finish == "stop" and stream.calls and all(c.complete for c in stream.calls):
        return "tool_calls"
    return engine_finish
