"""The request bodies the routes take, as OpenAI's API defines them, their own rules, and OpenAI's error.

Each model checks what concerns its fields alone (``check``: schemas.requests' rules, with
``max_tokens`` against the context; what chatpipe does not support, as a 400 naming the field).
Turning a checked body into a record, with the parts that need more than the fields (the tools,
the response format's grammar, the rendered prompt, who the user is), is ``gateway/translate.py``;
nothing here calls it or builds a record.

- ``ChatCompletionRequest`` (POST /v1/chat/completions): every field of OpenAI's Chat Completions
  request is named here, and each is honoured, refused with a 400 naming it (``check_supported``:
  audio, a ``logit_bias``, the deprecated ``functions`` ...), or accepted and ignored for a reason
  docs/gateway.md ("Request fields") gives (and a comment at the field): nothing is ignored silently.
  A field that is not OpenAI's (nor chatpipe's ``top_k`` and ``cache``) is refused as OpenAI's own
  server refuses it ("Unrecognized request argument supplied", ``app.py``'s handler).
- ``CompletionRequest`` (POST /v1/completions, docs/gateway.md "Completions"), ``EmbeddingsBody``
  (POST /v1/embeddings, "Embeddings").

Reference: https://platform.openai.com/docs/api-reference/chat (object names, fields).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, field_validator

from schemas.embeddings import check_inputs
from schemas.records import Priority
from schemas.requests import (
    OPENAI_ROLES,
    RESPONSE_FORMAT_TYPES,
    TOOL_ROLE,
    RequestRuleError,
    check_conversation_id,
    check_messages,
    check_metadata,
    check_raw_prompt,
    check_sampling,
    check_user,
)

ENCODING_FORMATS = ("float", "base64")  # embeddings' encoding_format
MAX_LOGPROBS = 5  # OpenAI's bound of the legacy completions' logprobs
MAX_PROMPTS = 32  # prompts of one completions request: each is a request of the backlog, all in flight at once


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# The parts of a request ignore fields they do not know (pydantic's default; a message's ``name``, for
# one); the request bodies themselves refuse them (``extra="forbid"``, below).
class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str = ""


class ToolCall(BaseModel):
    """An assistant message's call, sent back in the history."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    role: str  # one of schemas.requests.OPENAI_ROLES (ChatCompletionRequest.check)
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message's: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    # include_obfuscation (OpenAI's random padding of stream events) is ignored, as unknown fields are: docs/gateway.md
    include_usage: bool = False


# OpenAI's ``service_tier`` -> the priority class a request runs in. ``flex`` is the batch class: slower
# (it runs where no interactive request waits), and refused with 429 when the fleet has no room for it
# soon (admission.py). chatpipe has no class above interactive, so ``priority`` runs as ``default`` does,
# and the answer says ``default``, as OpenAI's does for a project without priority processing.
SERVICE_TIERS = {None: Priority.INTERACTIVE, "auto": Priority.INTERACTIVE, "default": Priority.INTERACTIVE,
                 "priority": Priority.INTERACTIVE, "flex": Priority.BATCH}


def service_tier_served(priority: Priority) -> str:
    """The ``service_tier`` an answer echoes: the tier its class served it in."""
    return "flex" if priority is Priority.BATCH else "default"


class SamplingFields(BaseModel):
    """The fields chat and legacy completions requests share (``translate.sampling_params`` makes the
    record's ``SamplingParams`` of them)."""

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
    # Not OpenAI's: chatpipe's (extra_body {"cache": false}): false opts the request out of streams' response
    # cache, true opts in against its key's default (translate.response_cache_of). Strict: "no" or 0 is a 400.
    cache: StrictBool | None = None

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        """``stream_options.include_usage``: a last event with the usage."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_shared(self, **endpoint: Any) -> None:
        """schemas.requests' rules on the fields both routes share, with the route's own (``endpoint``:
        logprobs, top_logprobs, response_format), and ``user`` as an id. Raises RequestRuleError."""
        check_sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                       stop=self.stop_list(), presence_penalty=self.presence_penalty,
                       frequency_penalty=self.frequency_penalty, n=self.n, **endpoint)
        if self.user:  # "" = no user, as OpenAI's clients send it
            check_user(self.user)


class ChatCompletionRequest(SamplingFields):
    messages: list[Message]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    # Tool calling (gateway/tools.py, called by translate).
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
    # Accepted and not acted on, each for its reason (docs/gateway.md "Request fields" says the same).
    # A latency hint (Predicted Outputs): the answer is the same without it.
    prediction: Any = None
    # Caching is automatic: the engine's prefix cache reuses any shared prompt prefix, and a conversation's
    # requests go to one worker by its id; it keeps cached prefixes while its KV blocks are free, with no
    # retention setting, cache breakpoints or lifetimes to set.
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None
    # OpenAI's abuse detection: chatpipe has none, and the end user whose memory a request uses is `user`.
    safety_identifier: str | None = None

    def check(self, context_tokens: int | None = None) -> None:
        """The fields' own rules, as OpenAI-shaped 400s naming the field: schemas.requests' (with
        ``context_tokens``, ``max_tokens`` against the model's context too), then what chatpipe does
        not support. The tools, the response format's schema and the prompt the tools are rendered
        into are checked by their parts when ``translate.chat_content`` calls them."""
        with rules_as_400():
            check_messages([(m.role, m.text()) for m in self.messages], roles=OPENAI_ROLES,
                           last_roles=("user", TOOL_ROLE))
            if self.response_format is not None and self.response_format.get("type") not in RESPONSE_FORMAT_TYPES:
                raise RequestRuleError("response_format.type", f"is {self.response_format.get('type')!r}; use one "
                                                               f"of {', '.join(RESPONSE_FORMAT_TYPES)}")
            for name in ("max_tokens", "max_completion_tokens"):
                check_sampling(max_tokens=getattr(self, name), context_tokens=context_tokens, max_tokens_field=name)
            self.check_shared(logprobs=self.logprobs, top_logprobs=self.top_logprobs,
                              response_format=self.response_format)
            if self.metadata is not None:
                check_metadata(self.metadata)
                if "conversation_id" in self.metadata:
                    check_conversation_id(self.metadata["conversation_id"], field="metadata.conversation_id")
        self.check_supported()

    def check_supported(self) -> None:
        """400 for what OpenAI's API has and chatpipe does not do (docs/gateway.md "Request fields")."""
        if self.functions:
            raise unsupported("functions", "functions (the deprecated form of tools) are not supported: send them "
                                           "as tools ([{\"type\": \"function\", \"function\": {...}}]) instead")
        if self.function_call not in (None, "none"):  # absent, or the value that asks for nothing
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
        if self.service_tier not in SERVICE_TIERS:
            raise unsupported("service_tier", f"service_tier {self.service_tier!r} is not one of OpenAI's tiers: use "
                                              '"auto", "default", "flex" or "priority", or leave it out',
                              code="unsupported_value")
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


class CompletionRequest(SamplingFields):
    prompt: str | list[Any]  # a string or a list of strings; token ids are refused (check)
    max_tokens: int | None = None  # None = 16, as OpenAI
    logprobs: int | None = None  # 0-5: the legacy logprobs object; None = none
    echo: bool | None = None
    # Refused unless absent (or the value that asks for nothing): check_supported says why.
    suffix: str | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_is_a_count(cls, value: Any) -> Any:
        if isinstance(value, bool):  # chat's logprobs: true; here it is how many alternatives
            raise ValueError("is a number of alternatives per token here (0-5), not a boolean: in "
                             "/v1/completions logprobs=0 returns the chosen tokens' logprobs")
        return value

    def prompts(self) -> list[str]:
        """The prompt(s) as a list of texts (400 for what is not a string or a list of strings)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if not self.prompt:
            raise OpenAIError(400, "prompt is an empty list: send a string or a list of strings", param="prompt",
                              code="invalid_value")
        if all(isinstance(p, str) for p in self.prompt):
            return list(self.prompt)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in self.prompt) or all(
                isinstance(p, list) for p in self.prompt):
            raise unsupported("prompt", "token-id prompts (a list of integers, or a list of such lists) are not "
                                        "supported: the pipeline carries text; send the prompt as a string "
                                        "(or a list of strings)", code="unsupported_value")
        raise OpenAIError(400, "prompt must be a string or a list of strings", param="prompt", code="invalid_type")

    def check(self, context_tokens: int | None = None) -> list[str]:
        """The prompts, once every rule holds: schemas.requests' (with ``context_tokens``, max_tokens
        against the model's context too), then what chatpipe does not do; 400s naming the field."""
        prompts = self.prompts()
        if len(prompts) > MAX_PROMPTS:
            raise OpenAIError(400, f"prompt has {len(prompts)} prompts, over the limit of {MAX_PROMPTS} per "
                                   "request; send them in several requests", param="prompt",
                              code="array_above_max_length")
        with rules_as_400():
            for i, text in enumerate(prompts):
                check_raw_prompt(text, field="prompt" if isinstance(self.prompt, str) else f"prompt[{i}]")
            if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise RequestRuleError("logprobs", f"is {self.logprobs}; use 0-{MAX_LOGPROBS} (0: the chosen tokens' "
                                                   "logprobs only)", limit=MAX_LOGPROBS)
            check_sampling(max_tokens=self.max_tokens, context_tokens=context_tokens)
            self.check_shared(logprobs=self.logprobs is not None, top_logprobs=self.logprobs)
        self.check_supported()
        return prompts

    def check_supported(self) -> None:
        if self.suffix:
            raise unsupported("suffix", "suffix (text after the completion, for fill-in-the-middle) is not "
                                        "supported: the served model is not trained for insertion; leave it out")
        if self.best_of is not None and self.best_of != self.choices:
            raise unsupported("best_of", f"best_of {self.best_of} with n {self.choices}: choosing the best of more "
                                         "candidates than are returned is not supported; leave best_of out (or equal "
                                         "to n) and rank the n choices by their logprobs", code="unsupported_value")
        if self.echo and self.logprobs is not None:
            raise unsupported("echo", "echo with logprobs asks for the prompt's own logprobs, which the engine does "
                                      "not compute; leave out one of them", code="unsupported_value")
        if self.logit_bias:
            raise unsupported("logit_bias", "logit_bias is not supported: chatpipe's sampler applies no per-token "
                                            "bias; leave it out")


class EmbeddingsBody(BaseModel):
    """OpenAI's embeddings request. ``input`` is typed here by hand (``texts``) so that a token-id
    array gets its own clear 400, not pydantic's union error."""

    model_config = ConfigDict(extra="forbid")
    model: str
    input: Any
    encoding_format: str | None = None
    dimensions: int | None = None
    user: str | None = None

    def texts(self) -> list[str]:
        """The texts to embed, in order; OpenAI-shaped 400s for anything else."""
        value = self.input
        if isinstance(value, str):
            texts = [value]
        elif isinstance(value, list):
            if value and all(isinstance(v, int) and not isinstance(v, bool) for v in value) or any(
                    isinstance(v, list) for v in value):
                raise OpenAIError(400, "input as token ids (an array of integers, or of arrays of integers) is not "
                                       "supported: the model's tokenizer is not OpenAI's. Send the text: a string, or "
                                       "a list of strings", param="input", code="invalid_value")
            bad = next((i for i, v in enumerate(value) if not isinstance(v, str)), None)
            if bad is not None:
                raise OpenAIError(400, f"input[{bad}] is {type(value[bad]).__name__}, not a string: send a string or "
                                       "a list of strings", param=f"input[{bad}]", code="invalid_type")
            texts = value
        else:
            raise OpenAIError(400, f"input is {type(value).__name__}: send a string or a list of strings",
                              param="input", code="invalid_type")
        with rules_as_400():
            check_inputs(texts)
        return texts

    def encoding(self) -> str:
        fmt = self.encoding_format or "float"
        if fmt not in ENCODING_FORMATS:
            raise OpenAIError(400, f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}; got {fmt!r}",
                              param="encoding_format", code="invalid_value")
        return fmt

    def check(self) -> None:
        """The rules that need no model: ``dimensions`` positive, ``user`` an id (streams checks the rest)."""
        if self.dimensions is not None and self.dimensions < 1:
            raise OpenAIError(400, f"dimensions must be at least 1, got {self.dimensions}; leave it out for the "
                                   "model's own", param="dimensions", code="invalid_value")
        if self.user:  # "" = no user, as OpenAI's clients send it
            with rules_as_400():
                check_user(self.user)


def unsupported(param: str, message: str, code: str = "unsupported_parameter") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


@contextmanager
def rules_as_400() -> Iterator[None]:
    """A schemas.requests rule's error raised inside, as OpenAI's 400 (``param``: the field it names)."""
    try:
        yield
    except RequestRuleError as exc:
        raise OpenAIError(400, str(exc), param=exc.field, code=exc.code) from None
