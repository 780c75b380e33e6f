"""OpenAI's chat-completions shapes: the request body we accept, the objects we answer with, errors.

Every field of OpenAI's Chat Completions request is named here, and each is either honoured,
refused with a 400 naming it (``ChatCompletionRequest.check``: audio, a ``logit_bias``, the
deprecated ``functions`` ...), or accepted and ignored for a reason docs/gateway.md ("Request fields") gives: nothing is
ignored silently. A field that is not OpenAI's (nor chatpipe's ``top_k``) is refused as
OpenAI's own server refuses it ("Unrecognized request argument supplied"). What a valid request
is (roles, limits, sampling ranges, ``max_tokens`` against the context, ``n``, ``response_format``'s
shape) is ``schemas.requests``, the definition streams and the worker check records with too;
whether a JSON schema compiles to a grammar is ``formats.response_format.check_response_format``.
``check`` answers their errors as 400s naming the field. Tool calling (``tools``, ``tool_choice``,
``parallel_tool_calls``, ``tool`` messages, assistant ``tool_calls``) is ``gateway.tools``.

Reference: https://platform.openai.com/docs/api-reference/chat (object names, fields, SSE format).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from formats.errors import FormatError
from formats.response_format import check_response_format
from gateway import tools as tooling
from schemas.records import SamplingParams
from schemas.requests import (
    LIMITS,
    OPENAI_ROLES,
    RESPONSE_FORMAT_TYPES,
    TOOL_ROLE,
    RequestLimits,
    RequestRuleError,
    check_conversation_id,
    check_messages,
    check_metadata,
    check_sampling,
    check_user,
    response_format_text,
)

log = logging.getLogger(__name__)


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


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = ""


class ToolCall(BaseModel):
    """An assistant message's call, sent back in the history."""
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str  # one of schemas.requests.OPENAI_ROLES (ChatCompletionRequest.check)
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message's: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    # include_obfuscation (OpenAI's random padding of stream events) is ignored: docs/gateway.md
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


# Fields of OpenAI's request that chatpipe accepts and does not act on, each with its reason
# (docs/gateway.md "Request fields" says the same; test_request_fields checks they agree).
IGNORED = {
    "prediction": "a latency hint (Predicted Outputs): the answer is the same without it",
    "prompt_cache_key": "caching is automatic: the engine's prefix cache reuses any shared prompt prefix, and a "
                        "conversation's requests go to one worker by its id",
    "prompt_cache_retention": "the engine keeps cached prefixes while its KV blocks are free, with no retention "
                              "setting",
    "prompt_cache_options": "as prompt_cache_retention: no cache breakpoints or lifetimes to set",
    "safety_identifier": "OpenAI's abuse detection: chatpipe has none, and the end user whose memory a request "
                         "uses is `user`, never this",
}

# What a field may be when chatpipe cannot honour it: None (absent) always; these values too.
_NO_TOOL = (None, "none")


class SamplingFields(BaseModel):
    """The fields chat and legacy completions requests share (``CompletionRequest`` in
    completions.py), and their translation into the record's ``SamplingParams``."""

    # OpenAI's server refuses an argument it does not know; so do we (app.py words the 400).
    model_config = ConfigDict(extra="forbid")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Ranges are schemas.requests' (check), so the gateway and the tiers behind it answer alike.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI's: vLLM's and SGLang's extension (extra_body), 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None  # None = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None

    @property
    def choices(self) -> int:
        return self.n or 1

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(self, max_tokens: int, **fields: Any) -> SamplingParams:
        """The record's sampling: what the request leaves out is the engine's default (e.g.
        temperature 0.7); ``fields`` are the endpoint's own (logprobs, response_format)."""
        sampling = SamplingParams(max_tokens=max_tokens, stop=self.stop_list(), seed=self.seed,
                                  presence_penalty=self.presence_penalty or 0.0,
                                  frequency_penalty=self.frequency_penalty or 0.0, n=self.choices, **fields)
        if self.temperature is not None:
            sampling.temperature = self.temperature
        if self.top_p is not None:
            sampling.top_p = self.top_p
        if self.top_k is not None:
            sampling.top_k = self.top_k
        return sampling


class ChatCompletionRequest(SamplingFields):
    messages: list[Message]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    # Tool calling (gateway.tools).
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Refused unless absent (or the value that asks for nothing): check() says which and why.
    functions: list[Any] | None = None
    function_call: Any = None
    logit_bias: dict[str, float] | None = None
    store: bool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    audio: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None
    moderation: Any = None
    # Accepted and ignored: IGNORED says why.
    prediction: Any = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None
    safety_identifier: str | None = None

    @property
    def top_logprobs_asked(self) -> int:
        return self.top_logprobs or 0

    def check(self, context_tokens: int | None = None, limits: RequestLimits = LIMITS) -> None:
        """What pydantic's types cannot say, as OpenAI-shaped 400s: schemas.requests' rules (with
        ``context_tokens``, ``max_tokens`` against the model's context too), then what chatpipe
        does not support, then whether ``response_format``'s schema compiles."""
        try:
            check_messages([(m.role, m.text()) for m in self.messages], limits, roles=OPENAI_ROLES,
                           last_roles=("user", TOOL_ROLE))
            self.check_tool_messages()
            spec = self.tool_spec()
            if self.response_format is not None and self.response_format.get("type") not in RESPONSE_FORMAT_TYPES:
                raise RequestRuleError("response_format.type", f"is {self.response_format.get('type')!r}; use one "
                                                               f"of {', '.join(RESPONSE_FORMAT_TYPES)}")
            if spec is not None and spec.active and response_format_text(self.response_format, limits) is not None:
                raise RequestRuleError("response_format", f"cannot be combined with tools (tool_choice "
                                                          f"{spec.mode!r}) yet: send tool_choice \"none\", or "
                                                          "leave response_format out")
            for name in ("max_tokens", "max_completion_tokens"):
                check_sampling(max_tokens=getattr(self, name), context_tokens=context_tokens, max_tokens_field=name)
            check_sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                           stop=self.stop_list(), presence_penalty=self.presence_penalty,
                           frequency_penalty=self.frequency_penalty, logprobs=self.logprobs,
                           top_logprobs=self.top_logprobs, n=self.n, response_format=self.response_format,
                           limits=limits)
            try:
                self.response_format_text(limits)  # its length as a record carries it
            except RequestRuleError as exc:
                if spec is None or not spec.active:
                    raise
                raise RequestRuleError("tools", f"are too large: their parameters schemas take {exc.reason}") from None
            check_messages(self.record_messages(), limits)  # with the tools rendered into the prompt
            if self.user:  # "" = no user, as OpenAI's clients send it
                check_user(self.user, limits)
            if self.metadata is not None:
                check_metadata(self.metadata, limits)
                if "conversation_id" in self.metadata:
                    check_conversation_id(self.metadata["conversation_id"], field="metadata.conversation_id")
        except RequestRuleError as exc:
            raise OpenAIError(400, str(exc), param=exc.field, code=exc.code) from None
        self.check_supported()
        check_schema(self.response_format)
        check_tool_schemas(self.tool_spec())

    def check_tool_messages(self) -> None:
        """Assistant ``tool_calls`` and ``tool`` messages as OpenAI requires them: a tool message
        answers a call of the assistant message before it, by ``tool_call_id``. Tool messages before
        any assistant message are taken as answering calls of the conversation's stored history (a
        conversation id's request sends only its new messages)."""
        calls: set[str] | None = None  # None: no assistant message yet
        for i, m in enumerate(self.messages):
            if m.tool_calls and m.role != "assistant":
                raise RequestRuleError(f"messages[{i}].tool_calls", f"is only allowed on assistant messages, not "
                                                                    f"{m.role!r} ones")
            if m.role == "assistant":
                calls = {c.id for c in m.tool_calls or ()}
            elif m.role == TOOL_ROLE:
                if not m.tool_call_id:
                    raise RequestRuleError(f"messages[{i}].tool_call_id", "is required on a tool message: the id of "
                                                                         "the call it answers")
                if calls is not None and m.tool_call_id not in calls:
                    raise RequestRuleError(f"messages[{i}].tool_call_id",
                                           f"is {m.tool_call_id!r}, which no tool_calls of the assistant message "
                                           "before it has: a tool message must answer a preceding call")
            elif calls is not None:
                calls = set()

    def tool_spec(self) -> tooling.ToolSpec | None:
        """What the request's tools ask for (RequestRuleError for a malformed one); None without tools."""
        return tooling.parse_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def record_messages(self) -> list[tuple[str, str]]:
        """The messages as the PromptRequest carries them (role + text): the tools in the system
        message, calls and their results as text (``tools.render_messages``), developer -> system."""
        spec = self.tool_spec()
        return tooling.render_messages(
            [(m.role, m.text(), [c.model_dump() for c in m.tool_calls] if m.tool_calls else None)
             for m in self.messages], spec)

    def check_supported(self) -> None:
        """400 for what OpenAI's API has and chatpipe does not do (docs/gateway.md "Request fields")."""
        if self.functions:
            raise unsupported("functions", "functions (the deprecated form of tools) are not supported: send them "
                                           "as tools ([{\"type\": \"function\", \"function\": {...}}]) instead")
        if self.function_call not in _NO_TOOL:
            raise unsupported("function_call", f"function_call is {self.function_call!r}: the deprecated form of "
                                               "tool_choice is not supported; use tool_choice (with tools)",
                              code="unsupported_value")
        if self.logit_bias:
            raise unsupported("logit_bias", "logit_bias is not supported: chatpipe's sampler applies no per-token "
                                            "bias; leave it out (use stop, or response_format to constrain output)")
        if self.store:
            raise unsupported("store", "store: true asks for OpenAI's stored-completions API (list and retrieve "
                                       "completions), which chatpipe does not have; leave it out. chatpipe keeps "
                                       "conversations by their id (docs/gateway.md)", code="unsupported_value")
        if self.service_tier not in (None, "auto", "default"):
            raise unsupported("service_tier", f"service_tier {self.service_tier!r} is not offered: chatpipe serves "
                                              "every request the same way; use \"auto\" or \"default\", or leave it "
                                              "out", code="unsupported_value")
        if self.modalities is not None and set(self.modalities) - {"text"}:
            raise unsupported("modalities", f"modalities {self.modalities!r}: chatpipe's models answer with text only; "
                                            'use ["text"] or leave it out', code="unsupported_value")
        if self.audio is not None:
            raise unsupported("audio", "audio output is not supported: chatpipe's models answer with text only")
        if self.reasoning_effort not in (None, "none"):
            raise unsupported("reasoning_effort", f"reasoning_effort {self.reasoning_effort!r}: the served model is "
                                                  "not a reasoning model; leave it out", code="unsupported_value")
        if self.verbosity is not None:
            raise unsupported("verbosity", "verbosity is not supported: the model has no verbosity control; leave it "
                                           "out (max_completion_tokens bounds the answer's length)")
        if self.web_search_options is not None:
            raise unsupported("web_search_options", "web_search_options: web search is not supported: chatpipe's "
                                                    "models answer from the prompt and the conversation's memory only")
        if self.moderation is not None:
            raise unsupported("moderation", "moderation is not supported: chatpipe runs no moderation model on "
                                            "requests or answers; leave it out")

    def response_format_text(self, limits: RequestLimits = LIMITS) -> str | None:
        """What ``PromptRequest.sampling.response_format`` carries: JSON text, None for free text;
        with tools (tool_choice not "none"), the tool-call constraint (``ToolSpec.constraint``)."""
        spec = self.tool_spec()
        if spec is not None and spec.active:
            return response_format_text(spec.constraint(), limits)
        return response_format_text(self.response_format, limits)


def unsupported(param: str, message: str, code: str = "unsupported_parameter") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


_grammar_missing_logged = False


def check_schema(response_format: dict[str, Any] | None) -> None:
    """400 naming the part of a ``response_format`` the grammar library cannot compile. Without the
    library in this process (a gateway installed without the engine's extra) the worker's own check
    answers it instead: an ``invalid_request`` final chunk, the same 400 (``error_for_chunk``)."""
    global _grammar_missing_logged
    if response_format is None or response_format.get("type") == "text":
        return
    try:
        if importlib.util.find_spec("xgrammar") is None:
            raise ImportError("xgrammar is not installed here (the engine's extra)")
        check_response_format(response_format)
    except ImportError as exc:
        if not _grammar_missing_logged:
            log.warning("response_format schemas are checked by the workers only: %s", exc)
            _grammar_missing_logged = True
    except FormatError as exc:
        raise OpenAIError(400, str(exc), param="response_format", code="invalid_value") from None


def check_tool_schemas(spec: tooling.ToolSpec | None) -> None:
    """400 naming the tool whose parameters schema the grammar library cannot compile (as
    ``check_schema``; without the library here the worker answers it)."""
    global _grammar_missing_logged
    if spec is None or not spec.active:
        return
    try:
        if importlib.util.find_spec("xgrammar") is None:
            raise ImportError("xgrammar is not installed here (the engine's extra)")
        tooling.check_parameters(spec)
    except ImportError as exc:
        if not _grammar_missing_logged:
            log.warning("tools' parameters schemas are checked by the workers only: %s", exc)
            _grammar_missing_logged = True
    except RequestRuleError as exc:
        raise OpenAIError(400, str(exc), param=exc.field, code=exc.code) from None


# -- what we answer ---------------------------------------------------------------------------------

def completion(request_id: str, model: str, choices: list[dict[str, Any]], tokens_in: int, tokens_out: int,
               created: int | None = None) -> dict[str, Any]:
    """A ``chat.completion``; ``choices`` from ``choice`` (index order)."""
    return {
        "id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": created or int(time.time()),
        "model": model, "choices": choices, "usage": usage(tokens_in, tokens_out),
    }


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
    # JSON has no -inf: OpenAI answers -9999.0 for a token the model gives no chance
    logprob = entry.logprob if math.isfinite(entry.logprob) else -9999.0
    return {"token": entry.token, "logprob": logprob, "bytes": list(entry.bytes)}


def usage(tokens_in: int, tokens_out: int) -> dict[str, int]:
    return {"prompt_tokens": tokens_in, "completion_tokens": tokens_out, "total_tokens": tokens_in + tokens_out}


def chunk(request_id: str, model: str, created: int, *, index: int = 0, delta: dict[str, Any] | None = None,
          logprobs: list[Any] | None = None, finish_reason: str | None = None, usage_: dict[str, int] | None = None,
          final_usage: bool = False) -> str:
    """One SSE event of a streamed completion (``chat.completion.chunk``) for choice ``index``;
    ``logprobs``: the ``TokenLogprob``s of this event's tokens (None: not asked)."""
    body: dict[str, Any] = {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk", "created": created,
                            "model": model}
    if final_usage:  # OpenAI's usage chunk: no choices, usage only (stream_options.include_usage)
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
