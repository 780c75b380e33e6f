"""OpenAI tool calling on chat completions: the request's tools into the prompt and a constraint,
the model's output back into ``tool_calls``.

The default model (SmolLM2-135M-Instruct) has no tool format in its chat template, so the gateway
uses the convention of the Hermes / Qwen2.5 templates (which SmolLM2's larger siblings were trained
with), and the records keep carrying messages as role + text:

- the tools are listed in the system message, one JSON object a line inside ``<tools></tools>``,
  with the instruction to answer a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (appended to the client's system message, or a system message of its own);
- an assistant message with ``tool_calls`` becomes an assistant message whose text is those calls
  written that way (after its content, if any);
- ``tool`` messages (results) become a user message of ``<tool_response>...</tool_response>`` blocks,
  consecutive results in one message, as Qwen2.5's template renders them.

The output is enforced by the grammar-constrained decoding of structured outputs: the record's
``sampling.response_format`` carries the internal ``chatpipe_tool_calls`` object
(``schemas.requests.TOOL_CALLS_FORMAT``; ``formats.response_format`` checks it, the worker's
``inference.engine.grammar`` compiles it). ``tool_choice``:
``required`` -> the output is a call to one of the tools, ``{"type": "function", ...}`` -> a call to
that one, the arguments generated to validate against the function's ``parameters`` schema;
``auto`` -> free text, in which a ``<tool_call>`` starts a call constrained the same way; ``none`` ->
the tools are not shown to the model and nothing is constrained. ``parallel_tool_calls`` false ->
exactly one call (required; a named function is always called once); true (OpenAI's default) -> up
to ``MAX_PARALLEL_CALLS``.

``ToolCallStream`` reads the output (streamed or whole) into OpenAI's deltas: content pieces, then
per call its header (index, ``call_...`` id, type, function name, ``arguments: ""``) and the
arguments' text in pieces as they come.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from formats.errors import FormatError
from formats.response_format import (
    MAX_PARALLEL_CALLS,
    NO_PARAMETERS,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALL_SEPARATOR,
    TOOL_CALL_TRIGGER,
    check_tool_parameters,
)
from schemas.requests import TOOL_CALLS_FORMAT, RequestRuleError

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_ID_CHARS = string.ascii_letters + string.digits
_TOOL_RESPONSE = "<tool_response>\n{}\n</tool_response>"
# What the model writes after <tool_call> up to the arguments (the grammar writes it exactly so;
# whitespace is free in ``auto`` mode, hence the \s*).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_TAIL = re.compile(r"\s*\}\s*</tool_call>")
_MAX_HEAD_CHARS = 256  # a head that is not a call by then is text

SYSTEM_TOOLS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
DEFAULT_SYSTEM = "You are a helpful assistant."


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]
    given: dict[str, Any]  # the function object as the client sent it (rendered into the prompt)


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools as chatpipe acts on them; ``mode``: "none", "auto" or "required" (a named
    function is "required" with ``forced`` its name)."""

    tools: tuple[Tool, ...]
    mode: str
    forced: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def constraint(self) -> dict[str, Any] | None:
        """The internal response_format object for the record (None: nothing to constrain)."""
        if not self.active:
            return None
        tools = [t for t in self.tools if self.forced is None or t.name == self.forced]
        return {"type": TOOL_CALLS_FORMAT,
                "tool_calls": {"mode": self.mode, "parallel": self.parallel,
                               "tools": [{"name": t.name, "parameters": t.parameters} for t in tools]}}

    def system_text(self) -> str:
        lines = "\n".join(json.dumps({"type": "function", "function": t.given}, ensure_ascii=False)
                          for t in self.tools)
        return SYSTEM_TOOLS.format(tools=lines)


def _rule(field_: str, message: str, code: str = "invalid_value") -> RequestRuleError:
    return RequestRuleError(field_, message, code=code)


def parse_tools(tools: Sequence[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolSpec | None:
    """The request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``, checked (RequestRuleError
    naming the field); None without tools. The parameters schemas' compilation is
    ``check_parameters``' (it needs the grammar library)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise _rule("tool_choice", f"is {tool_choice!r} but the request has no tools; send tools, or leave "
                                       "tool_choice out")
        if parallel_tool_calls is not None:
            raise _rule("parallel_tool_calls", "is only allowed when tools are specified; leave it out")
        return None
    if len(tools) > MAX_TOOLS:
        raise _rule("tools", f"has {len(tools)} tools, over the limit of {MAX_TOOLS}", code="array_above_max_length")
    parsed: list[Tool] = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise _rule(at, f"is a {type(tool).__name__}; give {{\"type\": \"function\", \"function\": {{...}}}}",
                        code="invalid_type")
        if tool.get("type") != "function":
            raise _rule(f"{at}.type", f"is {tool.get('type')!r}: chatpipe supports function tools only "
                                      "(type \"function\")", code="unsupported_value")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise _rule(f"{at}.function", "is missing or not an object; give {\"name\": ..., \"parameters\": {...}}",
                        code="invalid_type")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _rule(f"{at}.function.name", f"must be 1-64 characters of a-z, A-Z, 0-9, _ or -; got {name!r}")
        if any(t.name == name for t in parsed):
            raise _rule(f"{at}.function.name", f"{name!r} is the name of an earlier tool too; names must be unique")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise _rule(f"{at}.function.description", "must be a string", code="invalid_type")
        if fn.get("strict") is not None and not isinstance(fn.get("strict"), bool):
            raise _rule(f"{at}.function.strict", "must be a boolean", code="invalid_type")
        params = fn.get("parameters")
        if params is None:
            params = NO_PARAMETERS
        if not isinstance(params, Mapping):
            raise _rule(f"{at}.function.parameters", f"is a {type(params).__name__}; give a JSON Schema object",
                        code="invalid_type")
        given = {k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None}
        parsed.append(Tool(name, description, dict(params), given))
    forced = None
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        mode = tool_choice or "auto"
    elif isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        forced = fn.get("name") if isinstance(fn, Mapping) else None
        if not any(t.name == forced for t in parsed):
            raise _rule("tool_choice.function.name", f"is {forced!r}, which is not one of the tools "
                                                     f"({', '.join(t.name for t in parsed)})")
        mode = "required"
    elif isinstance(tool_choice, Mapping) and tool_choice.get("type") in ("allowed_tools", "custom"):
        raise _rule("tool_choice", f"of type {tool_choice.get('type')!r} is not supported; use \"auto\", \"none\", "
                                   "\"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    code="unsupported_value")
    else:
        raise _rule("tool_choice", f"is {tool_choice!r}; use \"auto\", \"none\", \"required\" or "
                                   "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    # A named function is called once (as OpenAI's forced function); parallel calls are to tools the model picks.
    return ToolSpec(tuple(parsed), mode, forced, parallel=parallel_tool_calls is not False and forced is None)


def check_parameters(spec: ToolSpec) -> None:
    """RequestRuleError naming the tool whose parameters schema the grammar library cannot enforce
    (``tools[i].function.parameters...``). Needs xgrammar (ImportError otherwise)."""
    for i, tool in enumerate(spec.tools):
        path = f"tools[{i}].function.parameters"
        try:
            check_tool_parameters(tool.parameters, path)
        except FormatError as exc:
            message = str(exc)
            raise RequestRuleError(f"tools[{i}]", f"(function {tool.name!r}): {message}") from None


# -- the prompt -------------------------------------------------------------------------------------

def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it (the grammar's form)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass  # kept as the client gave it: the model sees what was called
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False,
                                                                   separators=(", ", ": "))
    return f'{TOOL_CALL_BEGIN}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}{TOOL_CALL_END}'


def render_messages(messages: Sequence[tuple[str, str, Any]], spec: ToolSpec | None) -> list[tuple[str, str]]:
    """``(role, text, tool_calls)`` of the request (``tool_calls``: the assistant message's, else None)
    -> the records' ``(role, text)``: tools into the system message, calls and results as text."""
    out: list[tuple[str, str]] = []
    for role, text, tool_calls in messages:
        role = "system" if role == "developer" else role
        if role == "assistant" and tool_calls:
            calls = TOOL_CALL_SEPARATOR.join(call_text(c["function"]["name"], c["function"].get("arguments"))
                                             for c in tool_calls)
            text = f"{text}\n{calls}" if text.strip() else calls
        if role == "tool":
            block = _TOOL_RESPONSE.format(text)
            if out and out[-1][0] == "user" and out[-1][1].endswith("</tool_response>"):
                out[-1] = ("user", out[-1][1] + "\n" + block)
            else:
                out.append(("user", block))
            continue
        out.append((role, text))
    if spec is not None and spec.active:
        tools = spec.system_text()
        first_system = next((i for i, (r, _) in enumerate(out) if r == "system"), None)
        if first_system is None:
            out.insert(0, ("system", f"{DEFAULT_SYSTEM}\n\n{tools}"))
        else:
            out[first_system] = ("system", f"{out[first_system][1]}\n\n{tools}")
    return out


# -- the answer -------------------------------------------------------------------------------------

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
        joined = "".join(self.content)
        return joined if joined else None

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
        call = Call(len(self.calls), new_call_id(), name)
        self.calls.append(call)
        out.append({"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})
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
        if match is not None:
            self.calls[-1].complete = True
            self._buf = self._buf[match.end():]
            self._state = "text"
            return True
        if not _could_be_tail(self._buf):  # a call not closed as written: take the rest as text
            self.calls[-1].complete = True
            self._state = "text"
            return True
        return False


def _partial_suffix(text: str, token: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``token``."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


def _could_be_tail(text: str) -> bool:
    stripped = text.lstrip()
    if not stripped:
        return True
    if not stripped.startswith("}"):
        return False
    rest = stripped[1:].lstrip()
    return "</tool_call>".startswith(rest) or rest.startswith("</tool_call>")


@dataclass
class ParsedAnswer:
    content: str | None
    tool_calls: list[dict[str, Any]]


def parse_answer(text: str) -> ParsedAnswer:
    """A whole output: its content (None when it is only calls) and its calls in OpenAI's shape."""
    stream = ToolCallStream()
    stream.feed(text)
    stream.end()
    return ParsedAnswer(stream.text, [c.openai() for c in stream.calls])


def finish_reason(stream: ToolCallStream, engine_finish: str) -> str:
    """OpenAI's ``tool_calls`` when the model stopped after calling; else the engine's reason."""
    if engine_finish == "stop" and stream.calls and all(c.complete for c in stream.calls):
        return "tool_calls"
    return engine_finish


__all__ = ["MAX_PARALLEL_CALLS", "ToolCallStream", "ToolSpec", "finish_reason", "parse_answer", "parse_tools",
           "render_messages"]
