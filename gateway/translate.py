"""The one place a request body becomes a record: the gateway's forward direction.

    chat_request_to_prompt        POST /v1/chat/completions -> one PromptRequest
    completion_request_to_prompts POST /v1/completions      -> one PromptRequest (raw_prompt) per prompt
    embedding_request_to_record   POST /v1/embeddings       -> one EmbeddingRequest

Each runs its steps in one order, every step a function that takes what it needs and returns a
value (or raises the HTTP error naming the field), none calling back up:

1. the fields' own rules: ``body.check`` (``openai_api``: schemas.requests' rules, ``max_tokens``
   against the context, what chatpipe does not support);
2. chat only, ``chat_content``: the tools (``tools.check_tool_messages``, ``tools.parse_tools`` ->
   ``ToolSpec``), the response format (``record_response_format``: the record's JSON text, the
   tool-call constraint when tools are active, its grammar checked with ``formats.response_format``),
   the prompt's messages (``tools.render_messages``, checked again as the record carries them),
   the sampling (``sampling_params``);
3. the model (``check_model``: 404), the conversation (``conversation_id_of``);
4. who: ``keys.resolve_user`` (403 for a user the key may not name) -> the user id and the memory
   scope; ``keys.request_id_for`` (the id feedback proves ownership with);
5. the record, with ``reply_to`` and ``deadline_at``.

``GatewayService`` calls one of them once per request, then admits and produces the record. The
way back, a request's TokenChunks -> OpenAI's answers, is ``gateway/responses.py`` (and
``GatewayService.replies``); nothing here is used by it.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from formats.errors import FormatError
from formats.response_format import check_response_format
from gateway import tools
from gateway.keys import Principal, ResolvedUser, request_id_for, resolve_user
from gateway.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingsBody,
    SERVICE_TIERS,
    OpenAIError,
    SamplingFields,
    rules_as_400,
)
from gateway.settings import GatewaySettings
from schemas.records import (
    ChatMessage,
    EmbeddingRequest,
    MemoryScope,
    PromptRequest,
    SamplingParams,
    new_id,
    now_ms,
)
from schemas.requests import (
    CONVERSATION_ID,
    CONVERSATION_ID_RULE,
    RequestRuleError,
    check_messages,
    response_format_text,
)
from transport.model_catalog import ModelCatalog, ModelChoiceError

log = logging.getLogger(__name__)

TIMEOUT_HEADER = "X-Chatpipe-Timeout-S"  # the client's own first-token deadline, in seconds (``client_timeout_s``)
# Asked: whether streams' response cache may answer the request (``cache_header``); answered: ``hit`` when it did.
CACHE_HEADER = "X-Chatpipe-Cache"
CACHE_HEADER_VALUES = {"off": False, "no-store": False, "on": True, "default": None}
MEMORY_HEADER = "X-Chatpipe-Memory"  # off: the prompt neither recalls memory nor is remembered (``memory_header``)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat's: settings.default_max_tokens)


# -- the records ------------------------------------------------------------------------------------

def chat_request_to_prompt(body: ChatCompletionRequest, principal: Principal, settings: GatewaySettings, *,
                           conversation_id: str | None, reply_to: str, timeout_s: float | None = None,
                           cache: bool | None = None, models: ModelCatalog | None = None,
                           memory: bool = True) -> PromptRequest:
    """The ``PromptRequest`` of a chat request. ``conversation_id``: the one the client named in the
    X-Chatpipe-Conversation-Id header (None: the body's ``metadata.conversation_id``, else a new
    conversation); ``cache``: what the X-Chatpipe-Cache header asked (``cache_header``). Raises
    OpenAIError: 400 naming the field, 404 for a model not served, 403 for a user the key may not name or
    another tenant's model version (``models``: the versions of ``chat.models``)."""
    content = chat_content(body, context_tokens=settings.context_tokens, default_max_tokens=settings.default_max_tokens)
    check_model(body.model, settings.models, principal.tenant, models)
    conversation = conversation_id_of(conversation_id, body.metadata)
    user = resolve_user(principal, body.user)
    created_at = now_ms()
    return PromptRequest(
        request_id=request_id_for(principal, user.user_id, conversation), conversation_id=conversation,
        user_id=user.user_id, memory_scope=memory_scope(user), tenant=principal.tenant, created_at=created_at,
        model=body.model, messages=content.messages, sampling=content.sampling, stream=body.stream,
        reply_to=reply_to, reply_partition=0, deadline_at=deadline_at(created_at, settings, timeout_s),
        priority=SERVICE_TIERS[body.service_tier], share_weight=principal.share_weight,
        response_cache=response_cache_of(cache, body.cache, principal), memory=memory)


def completion_request_to_prompts(body: CompletionRequest, principal: Principal, settings: GatewaySettings, *,
                                  reply_to: str, timeout_s: float | None = None,
                                  cache: bool | None = None, models: ModelCatalog | None = None) -> list[PromptRequest]:
    """One ``PromptRequest`` per prompt of a text-completions request: ``raw_prompt`` set, no
    messages, each in a conversation of its own (streams passes it through without a chat template
    or memory). Raises OpenAIError as ``chat_request_to_prompt``."""
    prompts = body.check(settings.context_tokens)
    check_model(body.model, settings.models, principal.tenant, models)
    user = resolve_user(principal, body.user)
    response_cache = response_cache_of(cache, body.cache, principal)
    created_at = now_ms()
    records = []
    for text in prompts:
        conversation = new_id()
        sampling = sampling_params(body, body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS,
                                   logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0)
        records.append(PromptRequest(
            request_id=request_id_for(principal, user.user_id, conversation), conversation_id=conversation,
            user_id=user.user_id, memory_scope=memory_scope(user), tenant=principal.tenant, created_at=created_at,
            model=body.model, messages=[], raw_prompt=text, sampling=sampling, stream=body.stream,
            reply_to=reply_to, reply_partition=0, deadline_at=deadline_at(created_at, settings, timeout_s),
            share_weight=principal.share_weight, response_cache=response_cache))
    return records


def embedding_request_to_record(body: EmbeddingsBody, principal: Principal, settings: GatewaySettings, *,
                                reply_to: str) -> EmbeddingRequest:
    """The ``EmbeddingRequest`` of an embeddings request, after the rules that need no model (the
    input's shape and limits, ``encoding_format``, ``dimensions``, ``user``; streams checks the
    rest); keyed by a fresh request id. Raises OpenAIError (400, 403)."""
    texts = body.texts()
    body.encoding()
    body.check()
    user = resolve_user(principal, body.user)
    created_at = now_ms()
    return EmbeddingRequest(request_id=new_id(), tenant=principal.tenant, user_id=user.user_id,
                            created_at=created_at, model=body.model, inputs=texts, dimensions=body.dimensions,
                            reply_to=reply_to, reply_partition=0, deadline_at=deadline_at(created_at, settings))


# -- the parts --------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ChatContent:
    """What a chat request asks of the model, checked: the record's messages (the tools rendered
    into them) and sampling (the response format, or the tool-call constraint, in it)."""

    messages: list[ChatMessage]
    sampling: SamplingParams


def chat_content(body: ChatCompletionRequest, *, context_tokens: int | None, default_max_tokens: int) -> ChatContent:
    """Steps 1 and 2 of a chat request (the module docstring): its fields, its tools, its response
    format, its messages as the record carries them, its sampling. 400s naming the field."""
    body.check(context_tokens)
    with rules_as_400():
        tools.check_tool_messages(body.messages)
        spec = tools.parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        response_format = record_response_format(body.response_format, spec)
        messages = tools.render_messages(
            [(m.role, m.text(), [c.model_dump() for c in m.tool_calls] if m.tool_calls else None)
             for m in body.messages], spec)
        check_messages(messages)  # with the tools rendered into the prompt
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
    sampling = sampling_params(body, max_tokens, logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs or 0,
                               response_format=response_format)
    return ChatContent([ChatMessage(role, text) for role, text in messages], sampling)


def record_response_format(response_format: Mapping[str, Any] | None, spec: tools.ToolSpec | None) -> str | None:
    """What ``PromptRequest.sampling.response_format`` carries: OpenAI's object as JSON text, None for
    free text; with active tools (tool_choice not "none") the tool-call constraint
    (``ToolSpec.constraint``) instead, which a response format cannot be combined with yet.
    RequestRuleError for a rule it breaks; OpenAIError 400 naming the part of a schema the grammar
    cannot enforce (``formats.response_format``)."""
    if spec is None or not spec.active:
        text = response_format_text(response_format)
        if text is not None:
            _grammar_check(lambda: check_response_format(response_format), "response_format schemas")
        return text
    if response_format_text(response_format) is not None:
        raise RequestRuleError("response_format", f"cannot be combined with tools (tool_choice {spec.mode!r}) yet: "
                                                  "send tool_choice \"none\", or leave response_format out")
    try:
        text = response_format_text(spec.constraint())  # its length as a record carries it
    except RequestRuleError as exc:
        raise RequestRuleError("tools", f"are too large: their parameters schemas take {exc.reason}") from None
    _grammar_check(lambda: tools.check_parameters(spec), "tools' parameters schemas")
    return text


_grammar_missing_logged = False


def _grammar_check(check: Callable[[], None], what: str) -> None:
    """Run a check that needs the grammar library (xgrammar). Without it in this process (a gateway
    installed without the engine's extra) the worker's own check answers instead: an
    ``invalid_request`` final chunk, the same 400 (``responses.error_for_chunk``)."""
    global _grammar_missing_logged
    try:
        if importlib.util.find_spec("xgrammar") is None:
            raise ImportError("xgrammar is not installed here (the engine's extra)")
        check()
    except ImportError as exc:
        if not _grammar_missing_logged:
            log.warning("%s are checked by the workers only: %s", what, exc)
            _grammar_missing_logged = True
    except FormatError as exc:
        raise OpenAIError(400, str(exc), param="response_format", code="invalid_value") from None


def sampling_params(body: SamplingFields, max_tokens: int, **fields: Any) -> SamplingParams:
    """The record's sampling: what the request leaves out is the engine's default (e.g. temperature
    0.7); ``fields`` are the endpoint's own (logprobs, top_logprobs, response_format)."""
    given = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k") if getattr(body, name) is not None}
    return SamplingParams(max_tokens=max_tokens, stop=body.stop_list(), seed=body.seed, n=body.choices,
                          presence_penalty=body.presence_penalty or 0.0,
                          frequency_penalty=body.frequency_penalty or 0.0, **given, **fields)


def check_model(model: str, served: list[str], tenant: str = "", models: ModelCatalog | None = None) -> str:
    """404 ``model_not_found`` for a model this gateway does not serve, 403 ``model_forbidden`` for another
    tenant's version. Without ``models`` only the base models are served; with it, also the fine-tuned
    versions of ``chat.models`` and their names (``transport/model_catalog.py``). Returns the model whose
    workers answer (the exact version when one is named, else the base model)."""
    if models is not None:
        try:
            return models.check(model, tenant, served)
        except ModelChoiceError as exc:
            raise OpenAIError(exc.status, f"{str(exc)[0].upper()}{str(exc)[1:]}. `GET /v1/models` lists the "
                                          "models this key may use", param="model", code=exc.code) from None
    if model not in served:
        raise OpenAIError(404, f"The model `{model}` does not exist or you do not have access to it. "
                               f"Served: {', '.join(served)}", param="model", code="model_not_found")
    return model


def conversation_id_of(given: str | None, metadata: Mapping[str, str] | None) -> str:
    """The request's conversation: ``given`` (the X-Chatpipe-Conversation-Id header), else the body's
    ``metadata.conversation_id`` (checked with the body's fields), else a new one."""
    if not given:
        return (metadata or {}).get("conversation_id") or new_id()
    return checked_conversation_id(given, param="metadata.conversation_id")


def checked_conversation_id(conversation_id: str, *, param: str) -> str:
    """``conversation_id`` when it is one (400 naming ``param`` otherwise): a header's, a path's."""
    if not CONVERSATION_ID.fullmatch(conversation_id):
        raise OpenAIError(400, f"conversation id {conversation_id[:40]!r}: use {CONVERSATION_ID_RULE}", param=param,
                          code="invalid_value")
    return conversation_id


def memory_scope(user: ResolvedUser) -> MemoryScope:
    """An identified user's memory spans their conversations; one that is not recalls from this
    conversation only, so one key's many people never mix memories (docs/gateway.md)."""
    return MemoryScope.USER if user.identified else MemoryScope.CONVERSATION


def deadline_at(created_at: int, settings: GatewaySettings, timeout_s: float | None = None) -> int:
    """When this gateway stops waiting for the first token (epoch ms): the client gets its 504 then,
    and a tier that takes the request later answers it as expired instead of generating for nobody
    (e.g. work re-read after an outage). ``timeout_s``: the client's own (``X-Chatpipe-Timeout-S``),
    never longer than ``first_chunk_timeout_s``; admission refuses a request whose estimated first
    token comes later (``admission.py``)."""
    seconds = settings.first_chunk_timeout_s if timeout_s is None else min(timeout_s, settings.first_chunk_timeout_s)
    return created_at + round(seconds * 1000)


def client_timeout_s(header: str | None) -> float | None:
    """The ``X-Chatpipe-Timeout-S`` header: how long the client waits for the first token. 400 unless
    a positive number of seconds."""
    if header is None:
        return None
    try:
        seconds = float(header)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise OpenAIError(400, f"{TIMEOUT_HEADER} must be a positive number of seconds, got {header!r}",
                          param=TIMEOUT_HEADER, code="invalid_value")
    return seconds


def cache_header(header: str | None) -> bool | None:
    """The ``X-Chatpipe-Cache`` request header: ``off`` / ``no-store`` False (streams' response cache
    neither answers nor keeps this request), ``on`` True, ``default`` or absent None (the key's
    default). Any other value is a 400 naming the header: a misspelt opt-out must not pass as "cache"."""
    if header is None:
        return None
    value = header.strip().lower()
    if value not in CACHE_HEADER_VALUES:
        raise OpenAIError(400, f"{CACHE_HEADER} must be one of {', '.join(CACHE_HEADER_VALUES)}, got {header[:40]!r}",
                          param=CACHE_HEADER, code="invalid_value")
    return CACHE_HEADER_VALUES[value]


def memory_header(header: str | None) -> bool:
    """The ``X-Chatpipe-Memory`` request header: ``off`` (the prompt neither recalls memory nor is remembered:
    what a Batch API line that names no conversation sends, ``batch_runner.py``), ``on`` or absent (memory as
    the key and conversation give it). Any other value is a 400 naming the header."""
    if header is None or header.strip().lower() == "on":
        return True
    if header.strip().lower() == "off":
        return False
    raise OpenAIError(400, f"{MEMORY_HEADER} must be on or off, got {header[:40]!r}", param=MEMORY_HEADER,
                      code="invalid_value")


def response_cache_of(header: bool | None, body: bool | None, principal: Principal) -> bool:
    """``PromptRequest.response_cache``: whether streams' response cache may answer the request. What the
    request says (the ``X-Chatpipe-Cache`` header, the body's ``cache``) wins over its key's default
    (keys file ``response_cache``); when the two disagree the opt-out wins, since a request one of
    them keeps out of the cache must not be answered from it."""
    asked = [a for a in (header, body) if a is not None]
    if asked:
        return all(asked)
    return principal.response_cache
