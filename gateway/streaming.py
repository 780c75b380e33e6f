"""What the routes that answer through the pipeline share (``app.py``'s chat completions,
``completions.py``'s text completions): waiting while watching for the client going away, the
``requests`` metric's outcome of an error, and the headers that name the request or say that
streams' response cache answered it.

Its own module so that both import it and neither imports the other (``app.py`` adds the
completion routes: ``completions.py`` importing ``app.py`` back was a cycle).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Sequence

from fastapi import Request

from gateway.openai_api import OpenAIError
from gateway.translate import CACHE_HEADER

CONVERSATION_HEADER = "X-Chatpipe-Conversation-Id"
REQUEST_HEADER = "X-Chatpipe-Request-Id"  # completions: the request ids of its prompts, comma-separated


class ClientGone(Exception):
    """The client closed the connection before its answer was complete."""


def cache_headers(subs: Sequence[Any]) -> dict[str, str]:
    """``X-Chatpipe-Cache: hit`` when streams' response cache answered (``Submitted.response_cached``)
    every one of ``subs`` (a chat request's one; a completions request's prompts), as far as their chunks
    read so far say: a streamed answer's headers go with its first event, and every chunk of a hit says so.
    Nothing otherwise."""
    return {CACHE_HEADER: "hit"} if subs and all(sub.response_cached for sub in subs) else {}


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
