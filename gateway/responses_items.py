"""OpenAI's Responses API in the words of chat completions, and back: a request's ``input`` items (and the
chain ``previous_response_id`` points to) as chat messages, its tools, tool choice and ``text.format`` as
chat's; a chat answer (text, tool calls) as Responses output items, the ``response`` object and its
streamed events. Pure: no I/O (``responses_routes.py`` runs and stores them).

Reference: https://platform.openai.com/docs/api-reference/responses (objects, items, streaming events).
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.openai_api import OpenAIError


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. A field OpenAI has that is not here is refused (400), as chat's are; the
    ones here and not used say why in docs/gateway.md ("Responses")."""

    model_config = ConfigDict(extra="forbid")
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None  # ignored: the model writes its calls as it does
    truncation: Literal["auto", "disabled"] | None = None  # ignored: a chain too long for the context is a 400
    include: list[str] | None = None  # ignored: no reasoning or tool outputs to include
    reasoning: dict[str, Any] | None = None  # ignored: the models served here do not reason apart
    prompt_cache_key: str | None = None  # ignored: the prefix cache needs no key
    stream_options: dict[str, Any] | None = None  # ignored: usage always comes with response.completed


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


# -- request -> chat ---------------------------------------------------------------------------------

def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's ``input`` as chat messages (consecutive function calls become one assistant message)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(400, f"input[{i}].role must be user, system, developer or assistant",
                                  param=f"input[{i}].role", code="invalid_value")
            messages.append({"role": role, "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue  # nothing of a reasoning item is shown to the models served here
        else:
            raise OpenAIError(400, f"input[{i}] of type {kind!r} is not supported here: messages (text), "
                                   "function_call and function_call_output items are (docs/gateway.md)",
                              param=f"input[{i}].type", code="unsupported_value")
    return messages


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if part.get("type") not in ("input_text", "output_text", "text"):
                raise OpenAIError(400, f"{param}[{j}] of type {part.get('type')!r} is not supported: text only "
                                       "(the models served here read no images or files)",
                                  param=f"{param}[{j}].type", code="unsupported_value")
            parts.append(part.get("text", ""))
        return "".join(parts)
    raise OpenAIError(400, f"{param} must be a string or a list of text parts", param=param, code="invalid_type")


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output items as the chat messages a follow-up's context holds."""
    text = "".join(part.get("text", "") for item in output if item.get("type") == "message"
                   for part in item.get("content", []))
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                     "arguments": item["arguments"]}}
             for item in output if item.get("type") == "function_call"]
    if not text and not calls:
        return []
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


def chat_body(request: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completions body of a Responses request whose earlier turns are ``history``."""
    messages = ([{"role": "system", "content": request.instructions}] if request.instructions else []) + history
    body: dict[str, Any] = {"model": request.model, "messages": messages + input_messages(request.input)}
    for name, value in (("max_completion_tokens", request.max_output_tokens), ("temperature", request.temperature),
                        ("top_p", request.top_p), ("service_tier", request.service_tier),
                        ("user", request.user or request.safety_identifier)):
        if value is not None:
            body[name] = value
    if request.tools:
        body["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(request.tools)]
    if request.tool_choice is not None:
        choice = request.tool_choice
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.get("name")}}
                               if isinstance(choice, dict) else choice)
    fmt = (request.text or {}).get("format")
    if fmt and fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema", {}), "strict": fmt.get("strict", True)}}
    elif fmt and fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    return body


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise OpenAIError(400, f"tools[{i}] of type {tool.get('type')!r} is not supported: function tools are "
                               "(no hosted tools run here)", param=f"tools[{i}].type", code="unsupported_value")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


# -- chat answer -> Responses --------------------------------------------------------------------------

def output_items(text: str | None, tool_calls: list[dict[str, Any]] | None, message_id: str) -> list[dict[str, Any]]:
    """The output items of an answer: its text as a message, each tool call as a function_call item."""
    items: list[dict[str, Any]] = []
    if text or not tool_calls:
        items.append(message_item(message_id, text or "", "completed"))
    for call in tool_calls or []:
        items.append({"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}",
                      "call_id": call["id"], "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"], "status": "completed"})
    return items


def message_item(message_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": message_id, "status": status, "role": "assistant",
            "content": [output_text(text)] if status == "completed" else []}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage(tokens_in: int, tokens_out: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": tokens_in, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": tokens_out, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": tokens_in + tokens_out}


def response_object(response_id: str, request: ResponsesRequest, created_at: int, status: str,
                    output: list[dict[str, Any]], usage_: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None, model: str | None = None) -> dict[str, Any]:
    """OpenAI's ``response`` object."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": response_id, "object": "response", "created_at": created_at, "status": status,
            "background": request.background, "error": error, "incomplete_details": incomplete,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "model": model or request.model, "output": output, "parallel_tool_calls": True,
            "previous_response_id": request.previous_response_id, "store": request.store,
            "temperature": request.temperature if request.temperature is not None else 1.0,
            "text": request.text or {"format": {"type": "text"}},
            "tool_choice": request.tool_choice or "auto", "tools": request.tools or [],
            "top_p": request.top_p if request.top_p is not None else 1.0, "truncation": "disabled",
            "usage": usage_, "user": request.user, "metadata": request.metadata or {},
            "service_tier": request.service_tier or "default"}


def event(kind: str, sequence: int, **fields: Any) -> str:
    """One server-sent event of a streamed response."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence, **fields})}\n\n"
