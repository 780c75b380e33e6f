"""OpenAI's legacy text completions, ``POST /v1/completions``, through Kafka like chat.

Each prompt of the request (a string, or a list of strings) is one ``PromptRequest`` with
``raw_prompt`` set (v5) and no messages, in a conversation of its own; streams passes it through
with no chat template, no system prompt and no memory recall, and the worker tokenizes it as it
is (``inference/worker/prompts.py``). The body is ``openai_api.CompletionRequest``, its records
``translate.completion_request_to_prompts``'s; its answer comes back as chat's does
(``GatewayService``: ``submit_completion``, ``replies``); this module is the route and the answer's
legacy shapes. A completion is recorded as its conversation's turn (analytics,
archive) and never remembered. Why no memory: a raw prompt is a whole document the model
continues, not a user's message: recalled turns would have to be put in some template, and the
text the client gets would depend on earlier conversations, which no completions client expects.

Choices: prompt ``i``'s ``j``-th choice has OpenAI's index ``i * n + j``. ``logprobs`` (an int
0-5) gives OpenAI's legacy object, from the ``TokenLogprob`` records chat's logprobs come from:
``tokens``, ``token_logprobs``, ``top_logprobs`` (per position the chosen token and the ``logprobs``
most likely ones, so up to logprobs + 1 entries, as OpenAI says) and ``text_offset`` (each token's
character offset in the choice's text). ``echo`` is honoured without logprobs (the prompt is put
before the text); ``echo`` with logprobs, ``suffix``, ``best_of`` other than ``n``, token-id prompts
and ``logit_bias`` get 400s naming them. docs/gateway.md "Completions" lists every field.

Reference: https://platform.openai.com/docs/api-reference/completions
"""

from __future__ import annotations

import asyncio
import codecs
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from gateway.keys import Principal
from gateway.openai_api import CompletionRequest, OpenAIError
from gateway.responses import json_logprob, sse, usage
from gateway.service import Delta, GatewayService, Submitted
from gateway.streaming import REQUEST_HEADER, ClientGone, cache_headers, outcome_of, wait_for_answer
from gateway.translate import CACHE_HEADER, TIMEOUT_HEADER, cache_header, client_timeout_s
from schemas.records import TokenLogprob


# -- what we answer ---------------------------------------------------------------------------------

@dataclass
class Offsets:
    """A choice's character count so far, fed its tokens' bytes (a character split across tokens
    counts once it is whole): each token's ``text_offset``."""

    chars: int = 0
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    def feed(self, entries: list[TokenLogprob]) -> list[int]:
        out = []
        for e in entries:
            out.append(self.chars)
            self.chars += len(self.decoder.decode(e.bytes))
        return out


def legacy_logprobs(entries: list[TokenLogprob] | None, offsets: Offsets) -> dict[str, Any] | None:
    """OpenAI's legacy ``logprobs`` of a choice (or of a chunk's tokens) from ``TokenLogprob``s."""
    if entries is None:
        return None
    top = []
    for e in entries:
        alternatives = {e.token: json_logprob(e.logprob)}
        for t in e.top:
            alternatives.setdefault(t.token, json_logprob(t.logprob))
        top.append(alternatives)
    return {"tokens": [e.token for e in entries], "token_logprobs": [json_logprob(e.logprob) for e in entries],
            "top_logprobs": top, "text_offset": offsets.feed(entries)}


def text_completion(subs: list[Submitted], choices: list[dict[str, Any]] | None, *,
                    usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": f"cmpl-{subs[0].request_id}", "object": "text_completion", "created": subs[0].created,
                            "model": subs[0].model, "choices": choices if choices is not None else []}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def text_choice(index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}


def total_usage(subs: list[Submitted]) -> dict[str, Any]:
    """Usage summed over the prompts (each prompt's tokens once, its choices' completions all)."""
    return usage(sum(s.tokens_in for s in subs), sum(s.tokens_out for s in subs), sum(s.cached_tokens for s in subs))


# -- many prompts' replies as one ---------------------------------------------------------------------

class Merged:
    """Every prompt's ``replies`` as one iterator of (prompt index, Delta), in arrival order; the
    first error of any prompt ends it (``failed``: that prompt's index)."""

    def __init__(self, service: GatewayService, subs: list[Submitted]) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.failed: int | None = None
        self.tasks = [asyncio.ensure_future(self._pump(i, service.replies(sub))) for i, sub in enumerate(subs)]
        self.left = len(subs)

    async def _pump(self, i: int, deltas: AsyncIterator[Delta]) -> None:
        try:
            async for delta in deltas:
                self.queue.put_nowait((i, delta, None))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            self.queue.put_nowait((i, None, exc))
        else:
            self.queue.put_nowait((i, None, None))

    def __aiter__(self) -> "Merged":
        return self

    async def __anext__(self) -> tuple[int, Delta]:
        while self.left:
            i, delta, exc = await self.queue.get()
            if exc is not None:
                self.failed = i
                self.close()
                raise exc
            if delta is None:
                self.left -= 1
                continue
            return i, delta
        raise StopAsyncIteration

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()


def prompt_error(exc: OpenAIError) -> OpenAIError:
    """A pipeline error about the chat request's messages is about the prompt here (or about
    max_tokens, when a tier's rule names it: more than the context holds)."""
    if exc.param == "messages":
        exc.param = "max_tokens" if ": max_tokens " in exc.message else "prompt"
        exc.message = exc.message.replace("the length of the messages", "the length of the prompt")
    return exc


def add_completion_routes(app: FastAPI, authenticate: Callable, service: GatewayService) -> None:
    """``POST /v1/completions`` on ``app`` (create_app's one line)."""
    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest, principal: Principal = Depends(authenticate)):
        received = time.perf_counter()
        subs = await service.submit_completion(principal, body, received,
                                               traceparent=request.headers.get("traceparent"),
                                               timeout_s=client_timeout_s(request.headers.get(TIMEOUT_HEADER)),
                                               cache=cache_header(request.headers.get(CACHE_HEADER)))
        headers = {REQUEST_HEADER: ",".join(s.request_id for s in subs)}
        merged = Merged(service, subs)

        def fail(exc: OpenAIError) -> None:  # one prompt failed: the request did; the others stop
            for i, sub in enumerate(subs):
                if i == merged.failed:
                    service.finish(sub, outcome_of(exc))
                elif sub.complete:
                    service.finish(sub, "ok")
                else:
                    service.cancel(sub, "request_failed")

        try:
            first = await wait_for_answer(request, merged, body.stream)
        except ClientGone:
            merged.close()
            for sub in subs:
                service.cancel(sub, "client_disconnected")
            return PlainTextResponse("", status_code=499)
        except OpenAIError as exc:
            fail(exc)
            raise prompt_error(exc) from None
        headers |= cache_headers(subs)  # streamed: every prompt's answer known to be a hit by the first event
        n = body.choices
        echo = body.prompts() if body.echo else [""] * len(subs)
        if not body.stream:
            for sub in subs:
                service.finish(sub, "ok")
            choices = [text_choice(i * n + c.index, echo[i] + c.text, c.finish_reason,
                                   legacy_logprobs(c.logprobs, Offsets()))
                       for i, sub in enumerate(subs) for c in sub.choices]
            return JSONResponse(text_completion(subs, choices, usage_=total_usage(subs)), headers=headers)
        return StreamingResponse(events(service, subs, merged, first, echo, body.include_usage, fail),
                                 media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def events(service: GatewayService, subs: list[Submitted], merged: Merged, first: tuple[int, Delta] | None,
                 echo: list[str], include_usage: bool, fail: Callable[[OpenAIError], None]) -> AsyncIterator[str]:
    """The SSE body: ``text_completion`` objects, one per increment of a choice (its finish reason on
    its last); with echo each choice's prompt first; usage when asked, once every choice ended; ``[DONE]``."""
    n = len(subs[0].choices)
    offsets = {(i, j): Offsets() for i in range(len(subs)) for j in range(n)}
    finished = False

    def event(i: int, delta: Delta) -> str | None:
        if not (delta.text or delta.logprobs or delta.finish_reason):
            return None
        logprobs = legacy_logprobs(delta.logprobs, offsets[i, delta.index])
        return sse(text_completion(subs, [text_choice(i * n + delta.index, delta.text, delta.finish_reason, logprobs)]))

    try:
        for i, text in enumerate(echo):
            if text:
                for j in range(n):
                    yield sse(text_completion(subs, [text_choice(i * n + j, text, None, None)]))
        if first is not None and (out := event(*first)) is not None:
            yield out
        async for i, delta in merged:
            if (out := event(i, delta)) is not None:
                yield out
        if include_usage:
            yield sse(text_completion(subs, None, usage_=total_usage(subs)))
        yield sse("[DONE]")
        finished = True
        for sub in subs:
            service.finish(sub, "ok")
    except OpenAIError as exc:  # the pipeline failed mid-stream: OpenAI sends the error as an event
        yield sse(prompt_error(exc).body())
        yield sse("[DONE]")
        finished = True
        fail(exc)
    finally:
        merged.close()
        if not finished:  # Starlette cancelled us: the client went away
            for sub in subs:
                service.cancel(sub, "client_disconnected")


__all__ = ["add_completion_routes", "legacy_logprobs"]
