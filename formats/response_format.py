"""Structured outputs' pure half: which OpenAI ``response_format`` (and tool parameters schema) can
be enforced, and the tool-call text convention. No tokenizer, no model, no torch of its own.

``check_response_format(fmt)`` answers a ``FormatError`` that names the part of the schema that
cannot be enforced: the gateway calls it for its 400 before the request reaches Kafka, and the
engine's compiler (``inference.engine.grammar.GrammarCompiler``, which turns a format into a token
constraint for one tokenizer) runs the same checks before it compiles. Whether a schema compiles
is asked of xgrammar itself (``grammar_from_schema``, imported lazily: the engine's extra), so the
check and the compiler can never disagree.

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

Threads: ``check_response_format`` and ``check_tool_parameters`` are safe from any thread (the LRU of
checked schemas is ``functools.lru_cache``'s, which is thread-safe; xgrammar compiles in C++ and releases the GIL).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Mapping

from formats.errors import FormatError

ROOT = "response_format"
SCHEMA_PATH = f"{ROOT}.json_schema.schema"
SEPARATORS = (", ", ": ")
DEFAULT_CACHE_SIZE = 128

# Keywords xgrammar 0.2.9 accepts and does not enforce (measured: an instance breaking them passes).
UNSUPPORTED_KEYWORDS = {
    **{key: f"{key} is not enforced by the grammar engine" for key in (
        "uniqueItems", "contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas",
        "dependencies", "not")},
    **dict.fromkeys(("if", "then", "else"), "if/then/else is not enforced by the grammar engine"),
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
KNOWN_KEYWORDS = frozenset().union(
    UNSUPPORTED_KEYWORDS, ANNOTATIONS, OTHER_KEYWORDS, SCHEMA_MAP_KEYWORDS, SCHEMA_KEYWORDS, SCHEMA_LIST_KEYWORDS,
    COUNT_KEYWORDS, NUMBER_KEYWORDS, STRING_KEYWORDS)
_LOOKAROUND = re.compile(r"\(\?<?[=!]|\\[1-9]|\\k<")
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: .*? is false: )?")
NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # a json_schema's or a tool's name (OpenAI's rule)


def _bad(path: str, why: str) -> FormatError:
    return FormatError(f"{path}: {why}")


# -- the pure check ------------------------------------------------------------------------------


def parse_response_format(fmt: Mapping[str, Any] | str | None) -> tuple[str, Any] | None:
    """``fmt`` (OpenAI's response_format object, or its JSON text) -> ("json_object", None) or
    ("json_schema", schema); None for absent / {"type": "text"}. Raises FormatError."""
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
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
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
    """Raise ``FormatError`` naming the part of ``fmt`` that cannot be enforced (the
    gateway's 400); return None when a ``GrammarCompiler`` will compile it. No tokenizer needed."""
    parsed = parse_response_format(fmt)
    if parsed is None or parsed[0] == "json_object":
        return
    if parsed[0] == "tool_calls":
        for i, tool in enumerate(parsed[1]["tools"]):
            check_tool_parameters(tool["parameters"], f"{ROOT}.tool_calls.tools[{i}].parameters")
        return
    _check_schema(canonical(parsed[1]))


@functools.lru_cache(maxsize=DEFAULT_CACHE_SIZE)
def _check_schema(key: str) -> None:
    """``schema_grammar`` of a schema given as its ``canonical`` text, remembered for the last
    ``DEFAULT_CACHE_SIZE`` schemas that passed (a failure is not kept: it raises again)."""
    schema_grammar(json.loads(key))


def canonical(schema: Any) -> str:
    """Cache key: compact JSON text. Not sorted: property order is generation order."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def schema_grammar(schema: Any) -> Any:
    """The checked grammar of a json_schema's ``schema``: supported keywords first (the named part),
    then xgrammar's own compile; ``FormatError`` naming the deepest failing part otherwise."""
    subschemas: list[tuple[str, Any]] = []
    _walk(schema, SCHEMA_PATH, subschemas)
    try:
        return grammar_from_schema(schema)
    except ImportError:
        raise  # no xgrammar in this process: not the schema's fault
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError with a C++ location prefix
        reason = _clean(exc)
        raise _bad(_locate(schema, reason, subschemas[1:]), reason) from None


def _walk(node: Any, path: str, seen: list[tuple[str, Any]]) -> None:
    """Structure and supported keywords, the named part first; xgrammar checks the rest. Every
    (sub)schema met goes to ``seen`` as (path, schema), parents before their children."""
    seen.append((path, node))
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
                _walk(sub, f"{at}.{name}", seen)
        elif key in SCHEMA_KEYWORDS:
            _walk(value, at, seen)
        elif key in SCHEMA_LIST_KEYWORDS:
            if not isinstance(value, list) or not value:
                raise _bad(at, "must be a non-empty array of schemas")
            if key == "allOf" and len(value) > 1:
                raise _bad(at, "allOf with more than one schema is not enforced by the grammar engine; merge them")
            for i, sub in enumerate(value):
                _walk(sub, f"{at}[{i}]", seen)
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
    if "type" in node and not (kinds and all(isinstance(k, str) and k in TYPES for k in kinds)):
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
    text = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    return _XGR_PREFIX.sub("", text).strip() or type(exc).__name__


def _locate(schema: Any, reason: str, subschemas: list[tuple[str, Any]]) -> str:
    """The deepest of ``subschemas`` (``_walk``'s, below the root) that fails alone with the same
    reason (root $defs attached, so its references still resolve); the schema's root when none does."""
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema, Mapping) and k in schema}
    best, node = SCHEMA_PATH, schema
    for path, sub in subschemas:
        if not isinstance(sub, Mapping):
            continue
        probe = {**defs, **sub} if defs else sub
        try:
            grammar_from_schema(probe)
        except Exception as exc:  # noqa: BLE001 - any compile failure; its reason is compared below
            if _clean(exc) == reason and path.count(".") + path.count("[") > best.count(".") + best.count("["):
                best, node = path, sub
    if reason.startswith("Regex") and isinstance(node, Mapping) and "pattern" in node:
        best += ".pattern"  # the schema's own pattern (a property *name* pattern names patternProperties)
    return best


def grammar_from_schema(schema: Any) -> Any:
    """xgrammar's grammar of a JSON Schema, as the output is generated (no free whitespace,
    ``SEPARATORS``, strict). Raises what xgrammar raises; ``schema_grammar`` names the part."""
    import xgrammar

    return xgrammar.Grammar.from_json_schema(
        canonical(schema), any_whitespace=False, separators=SEPARATORS, strict_mode=True
    )


# -- tool calls (the gateway's tool_choice) ------------------------------------------------------
#
# The record's response_format carries {"type": "chatpipe_tool_calls", "tool_calls": {"mode", "parallel",
# "tools": [{"name", "parameters"}]}} (schemas.requests.TOOL_CALLS_FORMAT; never sent by clients). A call
# is written as the Hermes / Qwen2.5 convention has it (gateway/tools.py renders the tools into
# the system message, gateway/responses.py parses the calls back):
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
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise _bad(f"{at}.tools[{i}].name", f"required, 1-64 characters of a-z, A-Z, 0-9, _ or -; got {name!r}")
        params = tool.get("parameters")
        out.append({"name": name, "parameters": NO_PARAMETERS if params is None else params})
    return {"mode": spec["mode"], "parallel": bool(spec.get("parallel")), "tools": out}


def check_tool_parameters(schema: Any, path: str) -> None:
    """``FormatError`` naming the part (under ``path``, e.g. ``tools[0].function.parameters``)
    of a tool's parameters schema that cannot be enforced: the rules of a json_schema, and the
    arguments must be an object."""
    if isinstance(schema, bool) or not isinstance(schema, Mapping):
        raise _bad(path, "must be a JSON Schema object (the function's arguments are a JSON object)")
    kind = schema.get("type", "object")
    if kind != "object":
        raise _bad(f"{path}.type", f"must be 'object' (a function's arguments are a JSON object), got {kind!r}")
    try:
        _check_schema(canonical(schema))
    except FormatError as exc:
        message = str(exc)
        raise FormatError(path + message[len(SCHEMA_PATH):] if message.startswith(SCHEMA_PATH)
                          else f"{path}: {message}") from None
