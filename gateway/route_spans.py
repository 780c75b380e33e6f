"""The span of one call to a route that is not a generation (files, batches): opened with the route's
name, the method and the key's tenant, ended with how the call went (``chatpipe.outcome``: ``ok``, or the
OpenAI error code it answered)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, TypeVar

from fastapi import Request

from gateway.keys import Principal
from gateway.openai_api import OpenAIError
from transport.spans import SERVER, Span

T = TypeVar("T")


def route_span(service: Any, method: str, route: str, request: Request, principal: Principal) -> Span:
    return service.tracer.start(f"{method} {route}", request.headers.get("traceparent"), SERVER,
                                {"http.request.method": method, "http.route": route, "chatpipe.tenant": principal.tenant})


async def traced(span: Span, work: Callable[[], Awaitable[T]],
                 on_outcome: Callable[[str], None] = lambda outcome: None) -> T:
    """``await work()`` inside ``span``; the outcome goes to the span and to ``on_outcome`` (a counter)."""
    outcome = "error"
    try:
        result = await work()
        outcome = "ok"
        return result
    except OpenAIError as exc:
        outcome = exc.code or str(exc.status)
        raise
    finally:
        on_outcome(outcome)
        span.set("chatpipe.outcome", outcome)
        if outcome != "ok":
            span.fail(outcome)
        span.end()
