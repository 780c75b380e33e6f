"""The one definition of a valid chat request: roles, limits, sampling ranges, the context size.

Three tiers take requests and each checks them with these rules, so they can never disagree:

- the gateway, on the HTTP body, before anything is produced (a 4xx in OpenAI's shape);
- streams, on every ``PromptRequest`` it reads (a record produced straight to Kafka is refused
  with a dead letter and an error final chunk carrying the rule's message);
- the inference worker, on every ``InferenceRequest`` (roles and sampling; the message count and
  character limits are intake's, because streams assembles the request within the token budget).

Each rule raises ``RequestRuleError`` naming the field, the limit and what to change.

**Why these limits.** The prompt limits keep every record under the broker's message size
(``message.max.bytes``, 1 MiB by default) with room to spare: at 4 UTF-8 bytes per character, the
largest valid prompt plus the largest user id, stop strings and ids encodes to about 0.83 MB, so
even its dead letter (the record wrapped with a reason) fits (``RequestLimits.worst_case_bytes``,
tested by encoding such a record). Metadata follows OpenAI's limits (16 pairs, keys of 64 and values of
512 characters). Stop strings: 16 of at most 256 characters (the engine's text edge holds the longest
stop string's tail back from every increment).

**Sampling beyond the basics** (PromptRequest v5, issue 23), with OpenAI's ranges:
``presence_penalty`` and ``frequency_penalty`` in [-2, 2]; ``top_logprobs`` 0-20, and more than 0
only with ``logprobs``; ``n`` 1-8: every choice is one more sequence in the engine's running batch
(16 by default) for the whole answer, so 8 lets one request take half the batch at most and leaves
the rest to other requests; its answers (n times max_tokens, with logprobs) also stay well inside
one reply stream. ``response_format`` is OpenAI's object (``text``, ``json_object``, ``json_schema``
with a ``json_schema.schema`` object); records carry it as JSON text of at most 16,384 characters
(``response_format_text``), which keeps the largest valid record under the broker's limit. Whether
a schema compiles to a grammar is ``formats.response_format.check_response_format``'s rule (the
gateway runs it; a worker that cannot compile one answers ``invalid_request``).

**The context size** (prompt + answer tokens) is one setting, ``CHATPIPE_CONTEXT_TOKENS``, read by
streams (its assembly budget), the engine (its ``max_seq_len``) and the gateway (``max_tokens`` at
most the context - 1). The names each tier had before, ``CHATPIPE_STREAMS_CONTEXT_TOKENS`` and
``CHATPIPE_MAX_SEQ_LEN``, still work as deprecated aliases (a warning at start); when more than one
of the three names is set they must agree, else every tier refuses to start, naming them.
An explicit argument (``--max-seq-len``, ``EngineSettings(max_seq_len=...)``) still wins for that
process alone.

Pure: no environment is read here. ``context_tokens_from_env`` takes a mapping; the settings source
that hands it the environment is ``transport.context_settings.SharedContextTokens``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any


from schemas.errors import ChatpipeError

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")  # what the records carry and the chat templates know
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system message (gateway only)
TOOL_ROLE = "tool"  # OpenAI's tool result message: the gateway renders it as a user turn (gateway/tools.py)
OPENAI_ROLES = ROLES + tuple(ROLE_ALIASES) + (TOOL_ROLE,)

CONVERSATION_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
CONVERSATION_ID_RULE = "1-128 characters of A-Z a-z 0-9 . _ : @ -"
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # no newlines or escapes in ids that reach logs and keys
INT64 = (-(2**63), 2**63 - 1)  # Avro long: a seed outside cannot be encoded

DEFAULT_CONTEXT_TOKENS = 2048
MIN_CONTEXT_TOKENS = 16
CONTEXT_TOKENS_ENV = "CHATPIPE_CONTEXT_TOKENS"
DEPRECATED_CONTEXT_ENVS = ("CHATPIPE_STREAMS_CONTEXT_TOKENS", "CHATPIPE_MAX_SEQ_LEN")
_warned: set[str] = set()  # deprecated names already warned about in this process (once each)


class RequestRuleError(ChatpipeError):
    """A request outside one rule. ``field`` is OpenAI's ``param`` (``messages[2].content``,
    ``max_tokens``); ``limit`` the bound it broke; ``code`` OpenAI's error code for it. The message
    is the field followed by ``reason``: "top_p must be in (0, 1], got 2.0; use ..."."""

    def __init__(self, field: str, message: str, *, limit: Any = None, code: str = "invalid_value") -> None:
        super().__init__(f"{field} {message}")
        self.field, self.reason, self.limit, self.code = field, message, limit, code


def over_limit(field: str, size: str, limit: int, advice: str, *, per: str = "",
               code: str = "string_above_max_length") -> RequestRuleError:
    """A value over its bound, worded alike everywhere: "<field> <size>, over the limit of <limit>
    [<per>]; <advice>" ("input[2] is 30000 characters, over the limit of 20000 per text; shorten it")."""
    return RequestRuleError(field, f"{size}, over the limit of {limit}{' ' + per if per else ''}; {advice}",
                            limit=limit, code=code)


class ContextSizeError(ChatpipeError):
    """The context size is set in more than one way and the values disagree, or is not a size."""


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The bounds of one request. One instance, ``LIMITS``, is what every tier uses; another is for
    tests. A change here changes the gateway, streams and the worker together."""

    max_messages: int = 256
    max_message_chars: int = 100_000  # one message's content
    max_prompt_chars: int = 200_000  # all messages' content together
    max_user_chars: int = 256
    max_tenant_chars: int = 128
    max_metadata_pairs: int = 16
    max_metadata_key_chars: int = 64
    max_metadata_value_chars: int = 512
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_temperature: float = 2.0
    max_penalty: float = 2.0  # presence_penalty and frequency_penalty in [-max_penalty, max_penalty]
    max_top_logprobs: int = 20
    max_choices: int = 8  # n: each choice is a sequence of the engine's batch (module docstring)
    max_response_format_chars: int = 16_384  # the JSON text of response_format
    broker_message_bytes: int = 1_048_576  # Kafka's default message.max.bytes

    def __post_init__(self) -> None:
        if self.worst_case_bytes() > 0.9 * self.broker_message_bytes:
            raise ValueError(f"a request at these limits could encode to {self.worst_case_bytes()} bytes, over 90% "
                             f"of the broker's {self.broker_message_bytes}: lower max_prompt_chars")

    def worst_case_bytes(self) -> int:
        """An upper bound of the encoded PromptRequest at these limits: 4 UTF-8 bytes per character,
        a few bytes per message (role, lengths), a generous allowance for ids, model and addresses."""
        chars = (self.max_prompt_chars + self.max_user_chars + self.max_tenant_chars + 128
                 + self.max_stop_strings * self.max_stop_chars + self.max_response_format_chars)
        return 4 * chars + 24 * self.max_messages + 4096


LIMITS = RequestLimits()


# -- messages ---------------------------------------------------------------------------------------

def check_messages(messages: Sequence[tuple[str, str]], limits: RequestLimits = LIMITS, *,
                   roles: Sequence[str] = ROLES, last_roles: Sequence[str] = ("user",)) -> None:
    """``(role, text)`` pairs: at least one, at most ``max_messages``, known roles, each text and
    all together within the character limits, the last one a non-empty user message (or, with
    ``last_roles``, one of those: the gateway takes a tool result last, which it renders as a user turn)."""
    if not messages:
        raise RequestRuleError("messages", "is empty: no messages; send at least one user message")
    if len(messages) > limits.max_messages:
        raise over_limit("messages", f"has {len(messages)} messages", limits.max_messages, "send fewer (with a "
                         "conversation id, only the new message is needed: the pipeline keeps the history)",
                         code="array_above_max_length")
    check_roles([role for role, _ in messages], roles=roles)
    total = 0
    for i, (_, text) in enumerate(messages):
        if len(text) > limits.max_message_chars:
            raise over_limit(f"messages[{i}].content", f"is {len(text)} characters", limits.max_message_chars,
                             "shorten it", per="per message")
        total += len(text)
    if total > limits.max_prompt_chars:
        raise over_limit("messages", f"are {total} characters in all", limits.max_prompt_chars,
                         "shorten the prompt or send fewer messages")
    last_role, last_text = messages[-1]
    if last_role not in last_roles:
        raise RequestRuleError("messages", f"has no user message to answer (the last message is from {last_role!r}); "
                                           "end the messages with the user's" +
                               (" (or a tool result)" if TOOL_ROLE in last_roles else ""))
    if last_role == "user" and not last_text.strip():
        raise RequestRuleError(f"messages[{len(messages) - 1}].content",
                               "is empty: the user message needs the text to answer")


def check_raw_prompt(text: str, limits: RequestLimits = LIMITS, *, field: str = "raw_prompt") -> None:
    """A raw text prompt (PromptRequest v5 ``raw_prompt``, POST /v1/completions' ``prompt``): not
    empty, at most ``max_prompt_chars`` (the whole prompt of a chat request has the same bound)."""
    if not text:
        raise RequestRuleError(field, "is empty: a completion needs the text to continue")
    if len(text) > limits.max_prompt_chars:
        raise over_limit(field, f"is {len(text)} characters", limits.max_prompt_chars, "shorten it")


def check_roles(roles_given: Iterable[str], *, roles: Sequence[str] = ROLES) -> None:
    for i, role in enumerate(roles_given):
        if role not in roles:
            raise RequestRuleError(f"messages[{i}].role", f"is unknown: message {i} has role {role!r}; use one of "
                                                          f"{', '.join(roles)}")


# -- sampling ---------------------------------------------------------------------------------------

def check_sampling(*, max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                   top_k: int | None = None, seed: int | None = None, stop: Sequence[str] = (),
                   presence_penalty: float | None = None, frequency_penalty: float | None = None,
                   logprobs: bool | None = None, top_logprobs: int | None = None, n: int | None = None,
                   response_format: str | Mapping[str, Any] | None = None,
                   context_tokens: int | None = None, limits: RequestLimits = LIMITS,
                   max_tokens_field: str = "max_tokens") -> None:
    """Sampling parameters in range; None = not given (the default applies). With ``context_tokens``,
    ``max_tokens`` must leave the prompt at least one token of the context. ``max_tokens_field``:
    the name the caller gave it (OpenAI's ``max_completion_tokens`` is the same bound).
    ``response_format``: OpenAI's object, as a dict (the gateway) or its JSON text (a record)."""
    if max_tokens is not None:
        name = max_tokens_field
        if max_tokens < 1:
            raise RequestRuleError(name, f"is {max_tokens}; set {name} to at least 1", limit=1,
                                   code="integer_below_min_value")
        if context_tokens is not None and max_tokens > context_tokens - 1:
            raise RequestRuleError(name, f"is {max_tokens}, more than the model's context allows: the context holds "
                                         f"{context_tokens} tokens for the prompt and the answer together, so set "
                                         f"{name} to at most {context_tokens - 1} (less, the longer the prompt)",
                                   limit=context_tokens - 1, code="integer_above_max_value")
    if temperature is not None:
        _in_range("temperature", temperature, 0.0, limits.max_temperature, "use a number in that range (0 = greedy)")
    if top_p is not None and not (math.isfinite(top_p) and 0 < top_p <= 1):
        code = "decimal_below_min_value" if top_p <= 0 else "decimal_above_max_value"
        raise RequestRuleError("top_p", f"must be in (0, 1], got {top_p}; use a number above 0 and at most 1 "
                                        "(1 = no cut)", limit=(0, 1), code=code)
    if top_k is not None and top_k < 0:
        raise RequestRuleError("top_k", f"must be >= 0, got {top_k}; use 0 (off) or a positive number of tokens",
                               limit=0, code="integer_below_min_value")
    if seed is not None and not INT64[0] <= seed <= INT64[1]:
        raise RequestRuleError("seed", f"is {seed}, which does not fit a 64-bit signed integer; use one in "
                                       f"[{INT64[0]}, {INT64[1]}]", limit=INT64, code="integer_above_max_value")
    check_stop(stop, limits)
    for name, penalty in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if penalty is not None:
            _in_range(name, penalty, -limits.max_penalty, limits.max_penalty,
                      "use a number in that range (0 = off; positive values make the answer repeat itself less)")
    if top_logprobs is not None:
        _in_range("top_logprobs", top_logprobs, 0, limits.max_top_logprobs,
                  "ask for at most that many alternatives per token", kind="integer")
        if top_logprobs > 0 and not logprobs:
            raise RequestRuleError("top_logprobs", f"is {top_logprobs} but logprobs is not true; set logprobs to true "
                                                   "to get top_logprobs (or leave top_logprobs out)")
    if n is not None:
        _in_range("n", n, 1, limits.max_choices, f"ask for at most {limits.max_choices} choices per request (send "
                  "more requests for more)", kind="integer")
    if response_format is not None:
        response_format_of(response_format, limits)


# -- response_format --------------------------------------------------------------------------------

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")  # what a client may send
# Internal: the gateway's tool-call constraint (tool_choice required / a named function / auto), carried
# in the same record field; clients cannot send it (the gateway refuses it). Its object:
# {"type": "chatpipe_tool_calls", "tool_calls": {"mode": "required" | "auto", "parallel": bool,
#  "tools": [{"name": ..., "parameters": {JSON Schema}}]}} (inference/engine/grammar.py compiles it).
TOOL_CALLS_FORMAT = "chatpipe_tool_calls"
RECORD_FORMAT_TYPES = RESPONSE_FORMAT_TYPES + (TOOL_CALLS_FORMAT,)


def response_format_of(value: str | Mapping[str, Any] | None, limits: RequestLimits = LIMITS) -> dict | None:
    """OpenAI's ``response_format`` object, checked, from a dict or its JSON text (a record's
    ``sampling.response_format``); None for none or ``{"type": "text"}`` (free text). Raises
    RequestRuleError for text that is not JSON, an unknown type or a json_schema without its object.
    Whether the schema compiles is the grammar's rule, not this one."""
    if value is None:
        return None
    if isinstance(value, str):
        if len(value) > limits.max_response_format_chars:
            raise over_limit("response_format", f"is {len(value)} characters as JSON",
                             limits.max_response_format_chars, "use a smaller schema")
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise RequestRuleError("response_format", f"is not JSON text ({exc}); write OpenAI's response_format "
                                                      'object as JSON, e.g. {"type": "json_object"}') from None
    if not isinstance(value, Mapping):
        raise RequestRuleError("response_format", f"is a {type(value).__name__}, not an object; use e.g. "
                                                  '{"type": "json_object"}', code="invalid_type")
    kind = value.get("type")
    if kind not in RECORD_FORMAT_TYPES:
        raise RequestRuleError("response_format.type", f"is {kind!r}; use one of {', '.join(RESPONSE_FORMAT_TYPES)}")
    if kind == "text":
        return None
    if kind == TOOL_CALLS_FORMAT:
        spec = value.get("tool_calls")
        if not (isinstance(spec, Mapping) and spec.get("mode") in ("required", "auto")
                and isinstance(spec.get("tools"), list) and spec["tools"]
                and all(isinstance(t, Mapping) and isinstance(t.get("name"), str) for t in spec["tools"])):
            raise RequestRuleError("response_format.tool_calls", "must be {\"mode\": \"required\" | \"auto\", "
                                   "\"parallel\": bool, \"tools\": [{\"name\", \"parameters\"}, ...]} (the "
                                   "gateway's tool-call constraint)", code="invalid_type")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping):
            raise RequestRuleError("response_format.json_schema", "is missing or not an object; give "
                                   '{"name": ..., "schema": {...}, "strict": true}', code="invalid_type")
        schema = spec.get("schema", {})
        if not isinstance(schema, (Mapping, bool)):
            raise RequestRuleError("response_format.json_schema.schema", f"is a {type(schema).__name__}; give the "
                                   "JSON Schema as an object", code="invalid_type")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise RequestRuleError("response_format.json_schema.name", "must be a string", code="invalid_type")
    return dict(value)


def response_format_text(value: str | Mapping[str, Any] | None, limits: RequestLimits = LIMITS) -> str | None:
    """What a record's ``sampling.response_format`` holds for OpenAI's object: compact JSON text, key
    order kept (a schema's property order is the order the answer writes them); None for none or
    ``{"type": "text"}``. Checked like ``response_format_of``, the length included."""
    fmt = response_format_of(value, limits)
    if fmt is None:
        return None
    text = json.dumps(fmt, ensure_ascii=False, separators=(",", ":"))
    response_format_of(text, limits)  # the length rule, on the text the record carries
    return text


def check_stop(stop: Sequence[str], limits: RequestLimits = LIMITS) -> None:
    if len(stop) > limits.max_stop_strings:
        raise over_limit("stop", f"has {len(stop)} stop strings", limits.max_stop_strings, "send fewer",
                         code="array_above_max_length")
    for i, s in enumerate(stop):
        if len(s) > limits.max_stop_chars:
            raise over_limit(f"stop[{i}]", f"is {len(s)} characters", limits.max_stop_chars, "shorten it",
                             per="per stop string")


def _in_range(field: str, value: float, low: float, high: float, advice: str, kind: str = "decimal") -> None:
    """``value`` in [low, high] (NaN and infinities are not); ``kind``: the error code's, decimal or integer."""
    if not low <= value <= high:
        raise RequestRuleError(field, f"must be in [{low:g}, {high:g}], got {value}; {advice}", limit=(low, high),
                               code=f"{kind}_below_min_value" if value < low else f"{kind}_above_max_value")


# -- who and where ----------------------------------------------------------------------------------

def check_user(user: str, limits: RequestLimits = LIMITS, *, field: str = "user") -> None:
    """An end user's id: 1 to ``max_user_chars`` characters, no control characters."""
    _check_id(field, user, limits.max_user_chars, "the end user's id")


def _check_id(field: str, value: str, max_chars: int, what: str) -> None:
    if not value.strip():
        raise RequestRuleError(field, f"is empty; name {what}")
    if len(value) > max_chars:
        raise over_limit(field, f"is {len(value)} characters", max_chars, "use a shorter id (e.g. a hash of a longer "
                         "one)")
    if _CONTROL.search(value):
        raise RequestRuleError(field, "contains control characters (newline, tab, escape ...); use printable "
                                      "characters only")


def check_conversation_id(conversation_id: str, *, field: str = "conversation_id") -> None:
    if not CONVERSATION_ID.fullmatch(conversation_id):
        shown = conversation_id[:40] + ("..." if len(conversation_id) > 40 else "")
        raise RequestRuleError(field, f"is {shown!r}, not a conversation id; use {CONVERSATION_ID_RULE}",
                               limit=128)


def check_metadata(metadata: Mapping[str, str], limits: RequestLimits = LIMITS) -> None:
    if len(metadata) > limits.max_metadata_pairs:
        raise over_limit("metadata", f"has {len(metadata)} pairs", limits.max_metadata_pairs, "send fewer",
                         code="object_above_max_size")
    for key, value in metadata.items():
        if len(key) > limits.max_metadata_key_chars:
            raise over_limit("metadata", f"has a key of {len(key)} characters ({key[:40]!r}...)",
                             limits.max_metadata_key_chars, "use a shorter key")
        if len(value) > limits.max_metadata_value_chars:
            raise over_limit(f"metadata.{key}", f"is {len(value)} characters", limits.max_metadata_value_chars,
                             "shorten it", per="per value")


# -- whole records ----------------------------------------------------------------------------------

def check_prompt_request(request: Any, *, context_tokens: int | None = None, limits: RequestLimits = LIMITS) -> None:
    """Every rule, on a ``schemas.records.PromptRequest`` (what streams reads from ``chat.prompts``)."""
    if not request.request_id.strip():
        raise RequestRuleError("request_id", "is empty; every request needs its id")
    _check_id("tenant", request.tenant, limits.max_tenant_chars, "the tenant")
    check_user(request.user_id, limits, field="user_id")
    check_conversation_id(request.conversation_id)
    if getattr(request, "raw_prompt", None) is not None:  # v5: a raw text prompt instead of messages
        check_raw_prompt(request.raw_prompt, limits)
        if request.messages:
            raise RequestRuleError("messages", "must be empty with raw_prompt: a raw prompt is the whole text the "
                                               "model continues (no chat template); send one or the other")
    else:
        check_messages([(m.role, m.content) for m in request.messages], limits)
    check_record_sampling(request.sampling, context_tokens=context_tokens, limits=limits)
    check_share_weight(getattr(request, "share_weight", 1.0))


MAX_SHARE_WEIGHT = 1000.0  # a weight above this would let one tenant hold a batch for good


def check_share_weight(weight: float, *, field: str = "share_weight") -> None:
    """A tenant's weight in the fair share (PromptRequest v6, the keys file's ``weight``): a finite
    number in (0, MAX_SHARE_WEIGHT]."""
    if not (isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight)
            and 0 < weight <= MAX_SHARE_WEIGHT):
        raise RequestRuleError(field, f"is {weight!r}; a weight is a number above 0 and at most "
                                      f"{MAX_SHARE_WEIGHT:g} (1 = an equal share)")


def check_record_sampling(sampling: Any, *, context_tokens: int | None = None, limits: RequestLimits = LIMITS) -> None:
    """``check_sampling`` on a ``schemas.records.SamplingParams``."""
    # Its fields are check_sampling's parameters, one for one.
    check_sampling(**{f.name: getattr(sampling, f.name) for f in fields(sampling)},
                   context_tokens=context_tokens, limits=limits)


# -- the context size -------------------------------------------------------------------------------

def context_tokens_from_env(environ: Mapping[str, str]) -> int | None:
    """The one context size from ``CHATPIPE_CONTEXT_TOKENS`` or its deprecated aliases; None when
    none is set. Raises ContextSizeError when the names that are set disagree."""
    given: dict[str, int] = {}
    for name in (CONTEXT_TOKENS_ENV, *DEPRECATED_CONTEXT_ENVS):
        raw = environ.get(name, "").strip()
        if not raw:
            continue
        try:
            given[name] = int(raw)
        except ValueError:
            raise ContextSizeError(f"{name}={raw!r} is not a number of tokens; set {CONTEXT_TOKENS_ENV} to the "
                                   "model's context size, e.g. 2048") from None
    if not given:
        return None
    if len(set(given.values())) > 1:
        settings = ", ".join(f"{name}={value}" for name, value in given.items())
        raise ContextSizeError(f"the context size is set differently in {settings}: streams and the engine must "
                               f"use one size. Set only {CONTEXT_TOKENS_ENV} (the other names are deprecated "
                               "aliases of it)")
    value = next(iter(given.values()))
    if value < MIN_CONTEXT_TOKENS:
        raise ContextSizeError(f"{', '.join(given)}={value}: a context of fewer than {MIN_CONTEXT_TOKENS} tokens "
                               "cannot hold a prompt and an answer")
    if (old := [name for name in given if name != CONTEXT_TOKENS_ENV]) and not _warned.issuperset(old):
        _warned.update(old)
        log.warning("%s is deprecated: set %s=%d instead (one context size for streams, the engine and the "
                    "gateway)", " and ".join(old), CONTEXT_TOKENS_ENV, value)
    return value
