"""Structured outputs: OpenAI's ``response_format`` turned into a token constraint (xgrammar).

Two halves, used by two services:

- ``check_response_format(fmt)`` is pure (no tokenizer, no model): the gateway calls it to answer a
  400 that names the part of the schema that cannot be enforced, before the request reaches Kafka.
- ``GrammarCompiler(tokenizer, vocab_size)`` lives next to the engine (the inference worker builds one
  from its tokenizer); ``compiler.matcher(fmt)`` returns a fresh ``xgrammar.GrammarMatcher`` per
  request, the object ``Engine.add_request(..., constraint=...)`` takes (fill_next_token_bitmask /
  accept_token / is_terminated). Compiled grammars are kept in an LRU keyed by the canonical schema
  text (property order kept: it is the order the output is generated in).

What a schema means here (docs/engine.md, "Structured outputs"):

- ``json_object``: any JSON *object* (not any JSON value), nested values free.
- ``json_schema``: the output is generated to validate against the schema, whatever ``strict`` says
  (enforcing a non-strict schema is allowed and stronger). Properties not listed are not generated
  unless ``additionalProperties`` allows them. No free whitespace between tokens (separators ``", "``
  and ``": "``): a small model given free whitespace can emit newlines until ``max_tokens``.
- A keyword xgrammar does not enforce is refused, not ignored (a constraint silently dropped is a
  wrong answer): ``UNSUPPORTED_KEYWORDS``, ``oneOf``, ``allOf`` with more than one schema,
  ``multipleOf`` on a non-integer, an unknown ``format``, a ``pattern`` with look-around or
  back-references, string or number bounds in a schema without ``type``, a remote ``$ref``, and
  unknown keywords (typos such as ``requird``; ``x-`` extensions and annotations are fine).
- Over-strict but valid: ``pattern`` / ``patternProperties`` are matched against the whole string
  (as if anchored), ``maxLength`` counts UTF-8 bytes for non-ASCII text. The output still validates.

The end of the output: once the JSON is complete the matcher allows only the stop tokens (the
engine's EOS, ``<|im_end|>`` for the chat template), so the request ends with finish_reason "stop".
A string the model never closes still runs to ``max_tokens`` (finish_reason "length", JSON cut off),
as with OpenAI.

Threads: ``check_response_format`` and ``GrammarCompiler.compile`` are safe from any thread (the
LRUs are locked; xgrammar compiles in C++ and releases the GIL). A first compile of a schema takes a
few ms (docs/engine.md), so calling it on the worker's event loop thread is acceptable; a matcher
is then used by one thread only (the engine's step thread): ``GrammarMatcher`` is not thread-safe.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from inference.engine.errors import InvalidRequestError

ROOT = "response_format"
SCHEMA_PATH = f"{ROOT}.json_schema.schema"
SEPARATORS = (", ", ": ")
DEFAULT_CACHE_SIZE = 128

# Keywords xgrammar 0.2.9 accepts and does not enforce (measured: an instance breaking them passes).
UNSUPPORTED_KEYWORDS = {
    "uniqueItems": "uniqueItems is not enforced by the grammar engine",
    "contains": "contains is not enforced by the grammar engine",
    "minContains": "minContains is not enforced by the grammar engine",
    "maxContains": "maxContains is not enforced by the grammar engine",
    "dependentRequired": "dependentRequired is not enforced by the grammar engine",
    "dependentSchemas": "dependentSchemas is not enforced by the grammar engine",
    "dependencies": "dependencies is not enforced by the grammar engine",
    "not": "not is not enforced by the grammar engine",
    "if": "if/then/else is not enforced by the grammar engine",
    "then": "if/then/else is not enforced by the grammar engine",
    "else": "if/then/else is not enforced by the grammar engine",
    "oneOf": "oneOf is not enforced (it would be matched as anyOf); use anyOf with disjoint schemas",
    "$dynamicRef": "$dynamicRef is not supported",
    "$recursiveRef": "$recursiveRef is not supported",
}
SUPPORTED_FORMATS = frozenset(
    "email date time date-time duration uuid uri uri-reference uri-template ipv4 ipv6 hostname "
    "json-pointer relative-json-pointer".split()
)
TYPES = frozenset(["string", "integer", "number", "boolean", "array", "object", "null"])
ANNOTATIONS = frozenset([
    "title", "description", "default", "examples", "$comment", "$schema", "$id", "$anchor", "readOnly",
    "writeOnly", "deprecated", "contentEncoding", "contentMediaType", "discriminator",
])  # fmt: skip
SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions")
SCHEMA_KEYWORDS = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames")
SCHEMA_LIST_KEYWORDS = ("anyOf", "allOf", "prefixItems")
COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
OTHER_KEYWORDS = frozenset(["type", "enum", "const", "required", "$ref", "nullable"])
KNOWN_KEYWORDS = (
    frozenset(UNSUPPORTED_KEYWORDS) | ANNOTATIONS | OTHER_KEYWORDS | frozenset(SCHEMA_MAP_KEYWORDS)
    | frozenset(SCHEMA_KEYWORDS) | frozenset(SCHEMA_LIST_KEYWORDS) | frozenset(COUNT_KEYWORDS)
    | frozenset(NUMBER_KEYWORDS) | frozenset(STRING_KEYWORDS)
)  # fmt: skip
_LOOKAROUND = re.compile(r"\(\?<?[=!]|\\[1-9]|\\k<")
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: .*? is false: )?")
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def _bad(path: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{path}: {why}")


# -- the pure check ------------------------------------------------------------------------------


def parse_response_format(fmt: Mapping[str, Any] | str | None) -> tuple[str, Any] | None:
    """``fmt`` (OpenAI's response_format object, or its JSON text) -> ("json_object", None) or
    ("json_schema", schema); None for absent / {"type": "text"}. Raises InvalidRequestError."""
    if fmt is None:
        return None
    if isinstance(fmt, str):
        try:
            fmt = json.loads(fmt)
        except ValueError as exc:
            raise _bad(ROOT, f"not JSON ({exc})") from None
    if not isinstance(fmt, Mapping):
        raise _bad(ROOT, f"must be an object, got {type(fmt).__name__}")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", None)
    if kind == TOOL_CALLS:
        return ("tool_calls", _tool_calls_spec(fmt.get("tool_calls")))
    if kind != "json_schema":
        raise _bad(f"{ROOT}.type", f"must be one of 'text', 'json_object', 'json_schema', got {kind!r}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, Mapping):
        raise _bad(f"{ROOT}.json_schema", "required, an object with 'name' and 'schema'")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(f"{ROOT}.json_schema.name", f"required, 1-64 characters of a-z, A-Z, 0-9, _ or -; got {name!r}")
    if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
        raise _bad(f"{ROOT}.json_schema.strict", f"must be a boolean, got {spec.get('strict')!r}")
    if "schema" not in spec:
        raise _bad(SCHEMA_PATH, "required: the JSON Schema the output must follow")
    schema = spec["schema"]
    if not isinstance(schema, (Mapping, bool)):
        raise _bad(SCHEMA_PATH, f"must be a JSON Schema object, got {type(schema).__name__}")
    return ("json_schema", schema)


def check_response_format(fmt: Mapping[str, Any] | str | None) -> None:
    """Raise ``InvalidRequestError`` naming the part of ``fmt`` that cannot be enforced (the
    gateway's 400); return None when a ``GrammarCompiler`` will compile it. No tokenizer needed."""
    parsed = parse_response_format(fmt)
    if parsed is None or parsed[0] == "json_object":
        return
    if parsed[0] == "tool_calls":
        for i, tool in enumerate(parsed[1]["tools"]):
            check_tool_parameters(tool["parameters"], f"{ROOT}.tool_calls.tools[{i}].parameters")
        return
    key = canonical(parsed[1])
    with _checked_lock:
        if key in _checked:
            _checked.move_to_end(key)
            return
    _check_schema(parsed[1])
    with _checked_lock:
        _checked[key] = None
        while len(_checked) > DEFAULT_CACHE_SIZE:
            _checked.popitem(last=False)


_checked: collections.OrderedDict[str, None] = collections.OrderedDict()
_checked_lock = threading.Lock()


def canonical(schema: Any) -> str:
    """Cache key: compact JSON text. Not sorted: property order is generation order."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _check_schema(schema: Any) -> None:
    _walk(schema, SCHEMA_PATH)
    try:
        _grammar_from_schema(schema)
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError with a C++ location prefix
        reason = _clean(exc)
        raise _bad(_locate(schema, reason), reason) from None


def _walk(node: Any, path: str) -> None:
    """Structure and supported keywords, the named part first; xgrammar checks the rest."""
    if isinstance(node, bool):
        return
    if not isinstance(node, Mapping):
        raise _bad(path, f"a schema must be an object or a boolean, got {type(node).__name__}")
    for key, value in node.items():
        at = f"{path}.{key}"
        if key in UNSUPPORTED_KEYWORDS:
            if key == "uniqueItems" and value is False:
                continue
            raise _bad(at, UNSUPPORTED_KEYWORDS[key])
        if key not in KNOWN_KEYWORDS and not key.startswith("x-"):
            raise _bad(at, "unknown JSON Schema keyword (a typo? it would be ignored, so it is refused)")
        if key in SCHEMA_MAP_KEYWORDS:
            if not isinstance(value, Mapping):
                raise _bad(at, f"must be an object of schemas, got {type(value).__name__}")
            for name, sub in value.items():
                _walk(sub, f"{at}.{name}")
        elif key in SCHEMA_KEYWORDS:
            _walk(value, at)
        elif key in SCHEMA_LIST_KEYWORDS:
            if not isinstance(value, list) or not value:
                raise _bad(at, "must be a non-empty array of schemas")
            if key == "allOf" and len(value) > 1:
                raise _bad(at, "allOf with more than one schema is not enforced by the grammar engine; merge them")
            for i, sub in enumerate(value):
                _walk(sub, f"{at}[{i}]")
        elif key in COUNT_KEYWORDS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise _bad(at, f"must be a non-negative integer, got {value!r}")
        elif key in NUMBER_KEYWORDS:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _bad(at, f"must be a number, got {value!r}")
    _check_types(node, path)


def _check_types(node: Mapping[str, Any], path: str) -> None:
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "type" in node:
        if not kinds or not all(isinstance(k, str) and k in TYPES for k in kinds):
            raise _bad(f"{path}.type", f"must be one of {sorted(TYPES)} or a list of them, got {kind!r}")
    if "required" in node and not (
        isinstance(node["required"], list) and all(isinstance(r, str) for r in node["required"])
    ):
        raise _bad(f"{path}.required", "must be an array of property names")
    if "enum" in node and not (isinstance(node["enum"], list) and node["enum"]):
        raise _bad(f"{path}.enum", "must be a non-empty array")
    if "$ref" in node and not (isinstance(node["$ref"], str) and node["$ref"].startswith("#")):
        raise _bad(f"{path}.$ref", f"only references inside the schema ('#/...') are supported, got {node['$ref']!r}")
    if "pattern" in node:
        if not isinstance(node["pattern"], str):
            raise _bad(f"{path}.pattern", "must be a string")
        if _LOOKAROUND.search(node["pattern"]):
            raise _bad(f"{path}.pattern", "look-around and back-references are not supported by the grammar engine")
    if "format" in node and node["format"] not in SUPPORTED_FORMATS:
        raise _bad(f"{path}.format", f"format {node['format']!r} is not enforced; supported: "
                                     f"{', '.join(sorted(SUPPORTED_FORMATS))}")
    if "multipleOf" in node:
        m = node["multipleOf"]
        if kinds != ["integer"] or isinstance(m, float) or m <= 0:
            raise _bad(f"{path}.multipleOf", "only a positive integer multipleOf on type 'integer' is enforced")
    if "type" not in node and "enum" not in node and "const" not in node:
        for key in (*STRING_KEYWORDS, *NUMBER_KEYWORDS):
            if key in node:
                raise _bad(f"{path}.{key}", f"{key} is enforced only in a schema with a 'type'; add one")


def _clean(exc: Exception) -> str:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    return _XGR_PREFIX.sub("", text).strip() or type(exc).__name__


def _locate(schema: Any, reason: str) -> str:
    """The deepest subschema that fails alone with the same reason (root $defs attached, so its
    references still resolve); the schema's root when none does."""
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema, Mapping) and k in schema}
    best = SCHEMA_PATH
    for path, sub in _subschemas(schema, SCHEMA_PATH):
        if not isinstance(sub, Mapping):
            continue
        probe = {**defs, **sub} if defs else sub
        try:
            _grammar_from_schema(probe)
        except Exception as exc:
            if _clean(exc) == reason and path.count(".") + path.count("[") > best.count(".") + best.count("["):
                best = path
    node = _at(schema, best)
    if reason.startswith("Regex") and isinstance(node, Mapping) and "pattern" in node:
        best += ".pattern"  # the schema's own pattern (a property *name* pattern names patternProperties)
    return best


def _at(schema: Any, path: str) -> Any:
    for found, sub in _subschemas(schema, SCHEMA_PATH):
        if found == path:
            return sub
    return schema


def _subschemas(node: Any, path: str) -> Iterable[tuple[str, Any]]:
    if not isinstance(node, Mapping):
        return
    for key, value in node.items():
        at = f"{path}.{key}"
        if key in SCHEMA_MAP_KEYWORDS and isinstance(value, Mapping):
            for name, sub in value.items():
                yield f"{at}.{name}", sub
                yield from _subschemas(sub, f"{at}.{name}")
        elif key in SCHEMA_KEYWORDS:
            yield at, value
            yield from _subschemas(value, at)
        elif key in SCHEMA_LIST_KEYWORDS and isinstance(value, list):
            for i, sub in enumerate(value):
                yield f"{at}[{i}]", sub
                yield from _subschemas(sub, f"{at}[{i}]")


def _grammar_from_schema(schema: Any) -> Any:
    import xgrammar

    return xgrammar.Grammar.from_json_schema(
        canonical(schema), any_whitespace=False, separators=SEPARATORS, strict_mode=True
    )


def _json_object_grammar() -> Any:
    import xgrammar

    # Any object with any JSON values; strict_mode=False so that properties are free.
    return xgrammar.Grammar.from_json_schema('{"type":"object"}', any_whitespace=False, separators=SEPARATORS,
                                             strict_mode=False)


# -- tool calls (the gateway's tool_choice) ------------------------------------------------------
#
# The record's response_format carries {"type": "chatpipe_tool_calls", "tool_calls": {"mode", "parallel",
# "tools": [{"name", "parameters"}]}} (schemas.requests.TOOL_CALLS_FORMAT; never sent by clients). A call
# is written as the Hermes / Qwen2.5 convention has it (gateway/tools.py renders the tools into
# the system message and parses the calls back):
#
#     <tool_call>
#     {"name": "get_weather", "arguments": {"city": "Paris"}}
#     </tool_call>
#
# mode "required": the output is one call (parallel: up to MAX_PARALLEL_CALLS, one per line) to one of
# the tools, its arguments generated to validate against the tool's parameters schema (as a json_schema,
# no free whitespace); then only the stop token. mode "auto": free text, in which a "<tool_call>" starts a
# call whose name and arguments are then constrained the same way (xgrammar's structural tags; JSON
# whitespace is free there), after which text is free again.

TOOL_CALLS = "chatpipe_tool_calls"
TOOL_CALL_TRIGGER = "<tool_call>"
TOOL_CALL_BEGIN = TOOL_CALL_TRIGGER + "\n"
TOOL_CALL_END = "\n</tool_call>"
TOOL_CALL_SUFFIX = "}" + TOOL_CALL_END  # closes the call object after its arguments
TOOL_CALL_SEPARATOR = "\n"  # between parallel calls
MAX_PARALLEL_CALLS = 4
NO_PARAMETERS = {"type": "object", "properties": {}}


def tool_call_prefix(name: str) -> str:
    """What a call to ``name`` starts with, up to its arguments object."""
    return TOOL_CALL_BEGIN + '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '


def _tool_calls_spec(spec: Any) -> dict[str, Any]:
    at = f"{ROOT}.tool_calls"
    if not isinstance(spec, Mapping):
        raise _bad(at, "required, an object with 'mode' and 'tools'")
    if spec.get("mode") not in ("required", "auto"):
        raise _bad(f"{at}.mode", f"must be 'required' or 'auto', got {spec.get('mode')!r}")
    tools = spec.get("tools")
    if not isinstance(tools, list) or not tools:
        raise _bad(f"{at}.tools", "must be a non-empty array of {name, parameters}")
    out = []
    for i, tool in enumerate(tools):
        name = tool.get("name") if isinstance(tool, Mapping) else None
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(f"{at}.tools[{i}].name", f"required, 1-64 characters of a-z, A-Z, 0-9, _ or -; got {name!r}")
        params = tool.get("parameters")
        out.append({"name": name, "parameters": NO_PARAMETERS if params is None else params})
    return {"mode": spec["mode"], "parallel": bool(spec.get("parallel")), "tools": out}


def check_tool_parameters(schema: Any, path: str) -> None:
    """``InvalidRequestError`` naming the part (under ``path``, e.g. ``tools[0].function.parameters``)
    of a tool's parameters schema that cannot be enforced: the rules of a json_schema, and the
    arguments must be an object."""
    if isinstance(schema, bool) or not isinstance(schema, Mapping):
        raise _bad(path, "must be a JSON Schema object (the function's arguments are a JSON object)")
    kind = schema.get("type", "object")
    if kind != "object":
        raise _bad(f"{path}.type", f"must be 'object' (a function's arguments are a JSON object), got {kind!r}")
    key = "tool:" + canonical(schema)
    with _checked_lock:
        if key in _checked:
            _checked.move_to_end(key)
            return
    try:
        _check_schema(schema)
    except InvalidRequestError as exc:
        message = str(exc)
        raise InvalidRequestError(path + message[len(SCHEMA_PATH):] if message.startswith(SCHEMA_PATH)
                                  else f"{path}: {message}") from None
    with _checked_lock:
        _checked[key] = None
        while len(_checked) > DEFAULT_CACHE_SIZE:
            _checked.popitem(last=False)


def _literal(text: str) -> Any:
    import xgrammar

    return xgrammar.Grammar.from_ebnf("root ::= " + json.dumps(text))


def _tool_calls_grammar(spec: Mapping[str, Any]) -> Any:
    import xgrammar

    tools = spec["tools"]
    if spec["mode"] == "auto":
        tags = [xgrammar.StructuralTagItem(begin=tool_call_prefix(t["name"]), schema=canonical(t["parameters"]),
                                           end=TOOL_CALL_SUFFIX) for t in tools]
        return xgrammar.Grammar.from_structural_tag(tags, [TOOL_CALL_TRIGGER])
    calls = [xgrammar.Grammar.concat(_literal(tool_call_prefix(t["name"])), _grammar_from_schema(t["parameters"]),
                                     _literal(TOOL_CALL_SUFFIX)) for t in tools]
    call = calls[0] if len(calls) == 1 else xgrammar.Grammar.union(*calls)
    if not spec.get("parallel"):
        return call
    options, calls_so_far = [call], call
    for _ in range(MAX_PARALLEL_CALLS - 1):
        calls_so_far = xgrammar.Grammar.concat(calls_so_far, _literal(TOOL_CALL_SEPARATOR), call)
        options.append(calls_so_far)
    return xgrammar.Grammar.union(*options)


# -- the compiler (next to the engine) ----------------------------------------------------------


END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def default_stop_token_ids(tokenizer: Any) -> list[int]:
    """The chat template's end-of-turn token when the vocabulary has one, else the tokenizer's EOS.
    (SmolLM2's converted tokenizer names ``<|im_start|>`` as its EOS: not a stop for a chat turn.)
    Callers that know the engine's EOS ids pass them instead (``Engine.eos_token_ids``)."""
    vocab = tokenizer.get_vocab()
    ids = [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab]
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return ids


class GrammarCompiler:
    """Compiles response formats for one tokenizer; LRU of compiled grammars (thread-safe)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int] | None = None,
                 cache_size: int = DEFAULT_CACHE_SIZE, max_threads: int = 1) -> None:
        import xgrammar

        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids)) if stop_token_ids is not None \
            else default_stop_token_ids(tokenizer)
        if not self.stop_token_ids:
            raise InvalidRequestError("no stop token for structured outputs: pass stop_token_ids")
        # ~0.15 s for a 49k vocabulary: once per worker.
        self.tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids
        )
        # xgrammar's own cache off: ours is keyed by our canonical text and bounded by count.
        self._compiler = xgrammar.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self._closers = Closers.from_vocab(self.tokenizer_info.decoded_vocab, self.stop_token_ids)

    def compile(self, fmt: Mapping[str, Any] | str | None) -> Any:
        """The ``xgrammar.CompiledGrammar`` of ``fmt`` (None for text), from the LRU when it is there.
        Raises ``InvalidRequestError`` as ``check_response_format`` does."""
        parsed = parse_response_format(fmt)
        if parsed is None:
            return None
        key = "json_object" if parsed[0] == "json_object" else f"{parsed[0]}:" + canonical(parsed[1])
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        if parsed[0] == "json_object":
            grammar = _json_object_grammar()
        elif parsed[0] == "tool_calls":
            for i, tool in enumerate(parsed[1]["tools"]):
                check_tool_parameters(tool["parameters"], f"{ROOT}.tool_calls.tools[{i}].parameters")
            grammar = _tool_calls_grammar(parsed[1])
        else:
            _walk(parsed[1], SCHEMA_PATH)
            try:
                grammar = _grammar_from_schema(parsed[1])
            except Exception as exc:
                reason = _clean(exc)
                raise _bad(_locate(parsed[1], reason), reason) from None
        compiled = self._compiler.compile_grammar(grammar)
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, fmt: Mapping[str, Any] | str | None, max_tokens: int | None = None) -> Any:
        """A new matcher for one request (None for text / absent): the engine's ``constraint``.
        Its stop tokens are this compiler's ``stop_token_ids``.

        Without ``max_tokens``: a plain ``xgrammar.GrammarMatcher``. With it (the request's
        max_new_tokens): a ``BudgetedMatcher`` that closes the JSON before the budget runs out, so
        that a model repeating itself inside a string or an array still ends with valid JSON."""
        import xgrammar

        compiled = self.compile(fmt)
        if compiled is None:
            return None
        inner = xgrammar.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids)
        if max_tokens is None:
            return inner
        parsed = parse_response_format(fmt)
        assert parsed is not None
        if parsed[0] == "tool_calls":
            if parsed[1]["mode"] == "auto":  # free text may end anywhere: nothing to close
                return inner
            reserve = max(min_json_chars(t["parameters"]) for t in parsed[1]["tools"]) + len(TOOL_CALL_SUFFIX) \
                + CLOSE_SLACK
            return BudgetedMatcher(inner, max_tokens, reserve, self._closers, self.stop_token_ids)
        reserve = min_json_chars(parsed[1] if parsed[0] == "json_schema" else {"type": "object"}) + CLOSE_SLACK
        return BudgetedMatcher(inner, max_tokens, reserve, self._closers, self.stop_token_ids)

    def allocate_bitmask(self, rows: int) -> Any:
        """int32 [rows, ceil(vocab_size / 32)], all tokens allowed; what fill_next_token_bitmask fills."""
        import xgrammar

        return xgrammar.allocate_token_bitmask(rows, self.vocab_size)


# -- closing the JSON before max_tokens ---------------------------------------------------------

CLOSE_SLACK = 8  # tokens on top of the schema's shortest instance: the string / number being written


@dataclass(frozen=True)
class Closers:
    """Token ids that end the JSON soonest, in order of preference (longest first in each group).

    in_string: a quote closing the string, then ``]`` / ``}`` (``"``, ``"]``, ``"}``...);
    outside: ``]`` / ``}`` only; then ``,`` (only allowed after a value whose container cannot
    close yet: a required property or minItems is missing); then the shortest values (``""``,
    ``0``, ``[]``, ``{}``), then ``"`` (a string that must be written: enum, minLength)."""

    in_string: tuple[int, ...]
    outside: tuple[int, ...]
    token_bytes: tuple[bytes, ...]

    @classmethod
    def from_vocab(cls, decoded_vocab: list[bytes], stop_token_ids: Iterable[int]) -> "Closers":
        stops = set(stop_token_ids)

        def ids(pred: Any) -> list[int]:
            found = [i for i, t in enumerate(decoded_vocab) if i not in stops and t and pred(t)]
            return sorted(found, key=lambda i: -len(decoded_vocab[i]))

        closing = set(b"]}")
        in_string = ids(lambda t: t[:1] == b'"' and set(t[1:]) <= closing)
        brackets = ids(lambda t: set(t) <= closing)
        # "," after a value (when the container cannot close yet) before "0": inside a number, "0"
        # would be one more digit, forever.
        empties = [i for v in (b",", b'""', b"0", b"[]", b"{}", b'"') for i in ids(lambda t, v=v: t == v)]
        vocab = tuple(b"" if i in stops else t for i, t in enumerate(decoded_vocab))
        return cls(tuple(in_string), tuple(brackets + empties), vocab)


class BudgetedMatcher:
    """An ``xgrammar.GrammarMatcher`` (same protocol) that, once the tokens left reach the
    schema's shortest instance plus slack, leaves one token allowed: the first of ``Closers``
    the grammar allows here (else the grammar's own mask: a key, a separator, an enum value).

    Knows whether it is inside a JSON string from the bytes it accepted (quotes and backslashes),
    which is all the closing order needs. Greedy or sampled, the request then ends on the stop
    token with valid JSON. Not thread-safe (one request, the engine's step thread)."""

    def __init__(self, inner: Any, max_tokens: int, reserve: int, closers: Closers,
                 stop_token_ids: Iterable[int]) -> None:
        self._inner = inner
        self.max_tokens = max_tokens
        self.reserve = reserve
        self._closers = closers
        self._stops = frozenset(stop_token_ids)
        self.accepted = 0
        self.closing_steps = 0  # masks narrowed to a closer (for tests and metrics)
        self._in_string = False
        self._escape = False

    def fill_next_token_bitmask(self, bitmask: Any, index: int = 0, *args: Any, **kwargs: Any) -> Any:
        out = self._inner.fill_next_token_bitmask(bitmask, index, *args, **kwargs)
        if self.max_tokens - self.accepted <= self.reserve:
            row = bitmask[index]
            words = row.numpy() if row.device.type == "cpu" else row.cpu().numpy()
            for tid in (*sorted(self._stops), *(self._closers.in_string if self._in_string else self._closers.outside)):
                if (int(words[tid >> 5]) >> (tid & 31)) & 1:
                    row.zero_()
                    row[tid >> 5] = _bit(tid & 31)
                    self.closing_steps += 1
                    break
        return out

    def accept_token(self, token_id: int, *args: Any, **kwargs: Any) -> bool:
        ok = self._inner.accept_token(token_id, *args, **kwargs)
        if ok:
            self.accepted += 1
            if token_id not in self._stops:
                self._track(self._closers.token_bytes[token_id])
        return ok

    def is_terminated(self) -> bool:
        return self._inner.is_terminated()

    def __getattr__(self, name: str) -> Any:  # reset, rollback, find_jump_forward_string...
        return getattr(self._inner, name)

    def _track(self, data: bytes) -> None:
        for b in data:
            if self._escape:
                self._escape = False
            elif self._in_string and b == 0x5C:  # backslash
                self._escape = True
            elif b == 0x22:  # quote
                self._in_string = not self._in_string


def _bit(i: int) -> int:
    """1 << i as an int32 value (bit 31 is the sign bit)."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


def min_json_chars(schema: Any, defs: Mapping[str, Any] | None = None, depth: int = 0) -> int:
    """An upper bound, in characters (so in tokens), of the shortest JSON that ``schema`` accepts,
    written with ``SEPARATORS``: the budget to keep for closing an output."""
    if depth > 8 or not isinstance(schema, Mapping):
        return 4
    if defs is None:
        defs = {**schema.get("definitions", {}), **schema.get("$defs", {})} if isinstance(schema, Mapping) else {}
    if "const" in schema:
        return len(json.dumps(schema["const"]))
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    if "$ref" in schema:
        target = defs.get(str(schema["$ref"]).rsplit("/", 1)[-1])
        return min_json_chars(target, defs, depth + 1) if target is not None else 16
    if "anyOf" in schema or "allOf" in schema:
        return min(min_json_chars(s, defs, depth + 1) for s in schema.get("anyOf") or schema.get("allOf"))
    kind = schema.get("type", "object" if "properties" in schema else None)
    kinds = kind if isinstance(kind, list) else [kind]
    if "null" in kinds:
        return 4
    kind = kinds[0]
    if kind == "object":
        props = schema.get("properties", {})
        return 2 + sum(len(json.dumps(k)) + 4 + min_json_chars(props.get(k, {}), defs, depth + 1)
                       for k in schema.get("required", []))
    if kind == "array":
        prefix = schema.get("prefixItems", [])
        n = max(int(schema.get("minItems", 0)), 0)
        item = schema.get("items", {})
        return 2 + sum(min_json_chars(p, defs, depth + 1) + 2 for p in prefix[:n]) + \
            max(0, n - len(prefix)) * (min_json_chars(item, defs, depth + 1) + 2)
    if kind == "string":
        if "format" in schema or "pattern" in schema:
            return 48
        return 2 + int(schema.get("minLength", 0))
    if kind in ("integer", "number"):
        return max(len(str(schema.get(k, 0))) for k in ("minimum", "maximum", "exclusiveMinimum")) + 2
    if kind == "boolean":
        return 5
    return 4
