"""The request-body size limit: a body over ``max_body_bytes`` gets 413 in OpenAI's error shape.

An ASGI middleware, in front of routing and JSON parsing, so an oversized body is refused before
it is parsed (or authenticated). A declared ``Content-Length`` over the limit is answered at once,
from the headers; a body without one (chunked transfer) is read only up to the limit, then
refused. A body within the limit is handed on as it came, and afterwards the app reads the
connection as before (the route's disconnect watcher needs its ``http.disconnect``).

Before a 413 the rest of a body up to another ``max_bytes`` is read and dropped (for at most
``DRAIN_S``; before, because the server reads nothing more once the response is complete): closing
a socket with unread data sends a TCP reset, and a client still sending (httpx, OpenAI's SDK)
would see "connection reset" instead of the 413. A body declared larger than twice the limit is
not read at all: that client gets the 413 if it waits for it, a reset if it keeps sending.

A route may have a limit of its own (``routes``: path -> bytes): ``POST /v1/files`` takes files up to
``max_file_bytes`` (gateway/files.py), far above the JSON routes' limit.

Not here: the limits on fields inside the body (``schemas.requests``, checked by ``translate.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.openai_api import OpenAIError

DRAIN_S = 5.0  # longest a refused body is read and dropped before the connection closes


@dataclass(frozen=True)
class RouteLimit:
    """A body limit of its own for one path: its bytes, and how the 413 says where it comes from."""

    max_bytes: int
    setting: str  # the variable that sets it
    param: str
    hint: str


class BodySizeLimit:
    """``app.add_middleware(BodySizeLimit, max_bytes=..., routes={path: RouteLimit(...)})``."""

    def __init__(self, app: ASGIApp, max_bytes: int, routes: dict[str, RouteLimit] | None = None) -> None:
        self.app = app
        self.default = RouteLimit(max_bytes, "CHATPIPE_GATEWAY_MAX_BODY_BYTES", "messages",
                                  "Shorten the messages, or send only the new message with a conversation id (the "
                                  "pipeline keeps the history)")
        self.routes = routes or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.routes.get(scope.get("path", ""), self.default)
        declared = _content_length(scope)
        if declared is not None:
            if declared > limit.max_bytes:
                if declared <= 2 * limit.max_bytes:
                    await _drain(receive, declared)
                await _refuse(send, limit, f"the request body is {declared} bytes")
                return
            await self.app(scope, receive, send)  # the server reads no more than it declared
            return
        # No Content-Length (chunked): read up to the limit here, then replay what was read.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit.max_bytes:
                if message.get("more_body", False):
                    await _drain(receive, limit.max_bytes)
                await _refuse(send, limit, f"the request body is over {limit.max_bytes} bytes (sent without "
                                           "Content-Length, read up to the limit)")
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)


async def _refuse(send: Send, limit: RouteLimit, what: str) -> None:
    error = OpenAIError(413, f"{what}; this gateway takes request bodies of at most {limit.max_bytes} bytes "
                             f"({limit.setting}). {limit.hint}", param=limit.param, code="request_too_large")
    body = json.dumps(error.body()).encode()
    # Connection: close: the unread rest of the body must not be taken for the next request.
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


async def _drain(receive: Receive, most_bytes: int) -> None:
    """Read and drop the rest of a refused body: up to ``most_bytes``, for at most ``DRAIN_S``."""
    async def drop() -> None:
        dropped = 0
        while dropped <= most_bytes:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            dropped += len(message.get("body", b""))

    with contextlib.suppress(asyncio.TimeoutError):  # a client that keeps sending gets its connection closed on it
        await asyncio.wait_for(drop(), DRAIN_S)


def _content_length(scope: Scope) -> int | None:
    try:
        return int(Headers(scope=scope)["content-length"])
    except (KeyError, ValueError):
        return None  # none declared, or a malformed one (the server refuses that itself)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives ``body`` once, then whatever the connection says next (a disconnect)."""
    first: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return first.pop() if first else await receive()

    return replay
