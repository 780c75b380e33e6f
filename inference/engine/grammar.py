"""Structured outputs: OpenAI's ``response_format`` turned into a token constraint (xgrammar).

Two halves, used by two services:

- the pure check (``formats.response_format``: ``check_response_format(fmt)``, no tokenizer, no
  model): the gateway calls it to answer a 400 that names the part of the schema that cannot be
  enforced, before the request reaches Kafka; the compiler here runs the same checks.
- ``GrammarCompiler(tokenizer, vocab_size)`` lives next to the engine (the inference worker builds one
  from its tokenizer); ``compiler.matcher(fmt)`` returns a fresh ``xgrammar.GrammarMatcher`` per
  request, the object ``Engine.add_request(..., constraint=...)`` takes (fill_next_token_bitmask /
  accept_token / is_terminated). Compiled grammars are kept in an LRU keyed by the canonical schema
  text (property order kept: it is the order the output is generated in).

What a schema means (which keywords are enforced, refused, over-strict): ``formats.response_format``
and docs/engine.md, "Structured outputs". A format the compiler refuses raises the engine's
``InvalidRequestError`` naming the part at fault (the pure check's ``FormatError`` message).

The end of the output: once the JSON is complete the matcher allows only the stop tokens (the
engine's EOS, ``<|im_end|>`` for the chat template), so the request ends with finish_reason "stop".
A string the model never closes still runs to ``max_tokens`` (finish_reason "length", JSON cut off),
as with OpenAI.

Threads: ``GrammarCompiler.compile`` is safe from any thread (the LRU is locked; xgrammar compiles in
C++ and releases the GIL). A first compile of a schema takes a few ms (docs/engine.md), so calling it
on the worker's event loop thread is acceptable; a matcher is then used by one thread only (the
engine's step thread): ``GrammarMatcher`` is not thread-safe.
"""

from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from formats.errors import FormatError
from formats.response_format import (
    DEFAULT_CACHE_SIZE,
    MAX_PARALLEL_CALLS,
    ROOT,
    SEPARATORS,
    TOOL_CALL_SEPARATOR,
    TOOL_CALL_SUFFIX,
    TOOL_CALL_TRIGGER,
    canonical,
    check_tool_parameters,
    grammar_from_schema,
    parse_response_format,
    schema_grammar,
    tool_call_prefix,
)
from inference.engine.errors import InvalidRequestError


def _json_object_grammar() -> Any:
    import xgrammar

    # Any object with any JSON values; strict_mode=False so that properties are free.
    return xgrammar.Grammar.from_json_schema('{"type":"object"}', any_whitespace=False, separators=SEPARATORS,
                                             strict_mode=False)


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
    calls = [xgrammar.Grammar.concat(_literal(tool_call_prefix(t["name"])), grammar_from_schema(t["parameters"]),
                                     _literal(TOOL_CALL_SUFFIX)) for t in tools]
    call = calls[0] if len(calls) == 1 else xgrammar.Grammar.union(*calls)
    if not spec.get("parallel"):
        return call
    options, calls_so_far = [call], call
    for _ in range(MAX_PARALLEL_CALLS - 1):
        calls_so_far = xgrammar.Grammar.concat(calls_so_far, _literal(TOOL_CALL_SEPARATOR), call)
        options.append(calls_so_far)
    return xgrammar.Grammar.union(*options)


def grammar_of(fmt: Mapping[str, Any] | str | None) -> Any:
    """The xgrammar ``Grammar`` (not compiled: no tokenizer) of a response format, None for text.
    ``str()`` of it is its EBNF, which is how the vLLM engine hands the same grammar to vLLM
    (``inference/vllm_engine/constraints.py``). Raises the engine's ``InvalidRequestError`` as
    ``GrammarCompiler.compile`` does."""
    try:
        parsed = parse_response_format(fmt)
        return None if parsed is None else _grammar_of(parsed)
    except FormatError as exc:
        raise InvalidRequestError(str(exc)) from None


def _grammar_of(parsed: tuple[str, Any]) -> Any:
    if parsed[0] == "json_object":
        return _json_object_grammar()
    if parsed[0] == "tool_calls":
        for i, tool in enumerate(parsed[1]["tools"]):
            check_tool_parameters(tool["parameters"], f"{ROOT}.tool_calls.tools[{i}].parameters")
        return _tool_calls_grammar(parsed[1])
    return schema_grammar(parsed[1])


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

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int] | None = None) -> None:
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
        self._compiler = xgrammar.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.misses = 0
        self._closers = Closers.from_vocab(self.tokenizer_info.decoded_vocab, self.stop_token_ids)

    def compile(self, fmt: Mapping[str, Any] | str | None) -> Any:
        """The ``xgrammar.CompiledGrammar`` of ``fmt`` (None for text), from the LRU when it is there.
        Raises the engine's ``InvalidRequestError`` where ``formats.response_format.check_response_format``
        raises its ``FormatError``, with the same message."""
        try:
            return self._compile(fmt)
        except FormatError as exc:
            raise InvalidRequestError(str(exc)) from None

    def _compile(self, fmt: Mapping[str, Any] | str | None) -> Any:
        parsed = parse_response_format(fmt)
        if parsed is None:
            return None
        key = "json_object" if parsed[0] == "json_object" else f"{parsed[0]}:" + canonical(parsed[1])
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compiler.compile_grammar(_grammar_of(parsed))
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > DEFAULT_CACHE_SIZE:
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
        kind, spec = parse_response_format(fmt)
        if kind == "tool_calls":
            if spec["mode"] == "auto":  # free text may end anywhere: nothing to close
                return inner
            shortest = max(min_json_chars(t["parameters"]) for t in spec["tools"]) + len(TOOL_CALL_SUFFIX)
        else:
            shortest = min_json_chars(spec if kind == "json_schema" else {"type": "object"})
        return BudgetedMatcher(inner, max_tokens, shortest + CLOSE_SLACK, self._closers, self.stop_token_ids)


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
        defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
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
