"""What the routes that answer through the pipeline share (``app.py``'s chat completions,
``completions.py``'s text completions): waiting while watching for the client going away, the
``requests`` metric's outcome of an error, and the headers that name the request.

Its own module so that both import it and neither imports the other (``app.py`` adds the
completion routes: ``completions.py`` importing ``app.py`` back was a cycle).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from fastapi import Request

from gateway.openai_api import OpenAIError

CONVERSATION_HEADER = "X-Chatpipe-Conversation-Id"
REQUEST_HEADER = "X-Chatpipe-Request-Id"  # completions: the request ids of its prompts, comma-separated


class ClientGone(Exception):
    """The client closed the connection before its answer was complete."""


def outcome_of(exc: OpenAIError) -> str:
    """The ``requests`` metric's outcome of a request answered with ``exc``."""
    return "expired" if exc.code == "expired" else "error"


async def until_disconnect(request: Request, awaitable: Any) -> Any:
    """``awaitable``'s result, or ClientGone as soon as the client closes the connection."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if work.done():
        return work.result()
    work.cancel()
    raise ClientGone()


async def wait_for_answer(request: Request, answer: AsyncIterator[Any], stream: bool) -> Any:
    """Streamed: ``answer``'s first item (None when it has none), so that the HTTP status can follow
    it; else ``answer`` read to its end (None). ClientGone as soon as the client closes the connection."""
    async def drain() -> None:
        async for _ in answer:
            pass

    return await until_disconnect(request, anext(answer, None) if stream else drain())


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
