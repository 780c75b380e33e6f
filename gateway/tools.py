"""OpenAI tool calling on chat completions, the request's half: its tools into the prompt and a
constraint (the answer's half, the output back into ``tool_calls``, is ``gateway/responses.py``).

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
to ``formats.response_format.MAX_PARALLEL_CALLS``.

Each step is a function of what it needs, called by ``gateway/translate.py`` in this order:
``parse_tools`` (the request's tools -> ``ToolSpec``), ``check_tool_messages`` (tool results answer
calls), ``check_parameters`` (the schemas compile; needs the grammar library),
``ToolSpec.constraint`` (the record's response_format), ``render_messages`` (the prompt's messages).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from formats.errors import FormatError
from formats.response_format import (
    NAME_PATTERN,
    NO_PARAMETERS,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALL_SEPARATOR,
    check_tool_parameters,
)
from schemas.requests import TOOL_CALLS_FORMAT, TOOL_ROLE, RequestRuleError

MAX_TOOLS = 128  # OpenAI's limit
_TOOL_RESPONSE = "<tool_response>\n{}\n</tool_response>"

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


@dataclass(frozen=True)
class Tool:
    name: str
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
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise _rule(f"{at}.function.name", f"must be 1-64 characters of a-z, A-Z, 0-9, _ or -; got {name!r}")
        if any(t.name == name for t in parsed):
            raise _rule(f"{at}.function.name", f"{name!r} is the name of an earlier tool too; names must be unique")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise _rule(f"{at}.function.description", "must be a string", code="invalid_type")
        if fn.get("strict") is not None and not isinstance(fn.get("strict"), bool):
            raise _rule(f"{at}.function.strict", "must be a boolean", code="invalid_type")
        params = NO_PARAMETERS if fn.get("parameters") is None else fn["parameters"]
        if not isinstance(params, Mapping):
            raise _rule(f"{at}.function.parameters", f"is a {type(params).__name__}; give a JSON Schema object",
                        code="invalid_type")
        given = {k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None}
        parsed.append(Tool(name, dict(params), given))
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
        try:
            check_tool_parameters(tool.parameters, f"tools[{i}].function.parameters")
        except FormatError as exc:
            raise RequestRuleError(f"tools[{i}]", f"(function {tool.name!r}): {exc}") from None


def check_tool_messages(messages: Sequence[Any]) -> None:
    """Assistant ``tool_calls`` and ``tool`` messages (``openai_api.Message``s) as OpenAI requires
    them: a tool message answers a call of the assistant message before it, by ``tool_call_id``
    (RequestRuleError naming the message otherwise). Tool messages before any assistant message are
    taken as answering calls of the conversation's stored history (a conversation id's request sends
    only its new messages)."""
    calls: set[str] | None = None  # None: no assistant message yet
    for i, m in enumerate(messages):
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
