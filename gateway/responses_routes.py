"""OpenAI's Responses API: ``POST /v1/responses`` (plain, streamed, background), ``GET`` and ``DELETE
/v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``.

A response is a chat request underneath (``responses_items.chat_body``: its input items, the chain before
it, its tools, tool choice and ``text.format`` in chat's words), submitted as the chat route submits one
(``GatewayService.submit``: the same checks, admission, pipeline and memory), and its answer turned into
Responses output items. A chain (``previous_response_id``) is one conversation of the pipeline: its
responses share a conversation id (so memory works through it as through chat completions), and each
follow-up's context is the chain's messages, read from the stored responses
(``transport/response_store.py``, the compacted ``chat.api.responses`` every gateway follows): any replica
continues any chain, after a restart too. ``store: false`` keeps nothing (and so cannot be continued).

Streamed (``stream: true``): Responses' own server-sent events, ``response.created``,
``response.in_progress``, then per output item ``response.output_item.added``, for a message
``response.content_part.added``, ``response.output_text.delta`` as tokens come, ``.done`` events, for a
function call ``response.function_call_arguments.delta`` / ``.done`` (a request with tools is read whole
for its calls first, as chat's tool parsing needs the whole answer), ``response.output_item.done``, and
``response.completed`` with usage. ``background: true`` (with ``store``) answers ``queued`` at once and
runs on this gateway; ``GET`` polls it from any gateway; ``cancel`` (any gateway) marks it cancelled and
the gateway running it stops its generation.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import replace
from typing import Any, AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from gateway.keys import Principal, resolve_user
from gateway.openai_api import ChatCompletionRequest, OpenAIError
from gateway.responses_items import (ResponsesRequest, chat_body, event, input_messages, message_item, new_id,
                                     output_items, output_messages, output_text, response_object, usage)
from gateway.streaming import CONVERSATION_HEADER, REQUEST_HEADER, ClientGone, outcome_of, wait_for_answer
from schemas.records import StoredResponse
from transport.response_store import ENDED, ResponseStore, body_of

log = logging.getLogger(__name__)

ROUTE = "/v1/responses"
READ_YOUR_WRITE_S = 3.0  # how long a replica waits for a response another has just stored


def add_response_routes(app: FastAPI, authenticate: Callable[..., Principal], service: Any,
                        store: ResponseStore) -> "BackgroundResponses":
    background = BackgroundResponses(service, store)

    async def stored_or_404(principal: Principal, response_id: str, wait: bool = True) -> StoredResponse:
        stored = await asyncio.to_thread(store.get, response_id, principal.tenant, READ_YOUR_WRITE_S if wait else 0)
        if stored is None:  # another tenant's id is answered as one that never existed
            raise OpenAIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                              code="response_not_found")
        return stored

    @app.post(ROUTE)
    async def create(request: Request, body: ResponsesRequest, principal: Principal = Depends(authenticate)):
        received = time.perf_counter()
        if body.background and not body.store:
            raise OpenAIError(400, "background responses must be stored: drop store: false", param="store",
                              code="invalid_value")
        if body.background and body.stream:
            raise OpenAIError(400, "a background response is polled (GET /v1/responses/{id}), not streamed here",
                              param="stream", code="unsupported_value")
        history, conversation = [], request.headers.get(CONVERSATION_HEADER)
        if body.previous_response_id:
            previous = await stored_or_404(principal, body.previous_response_id)
            if previous.status not in ("completed", "incomplete"):
                raise OpenAIError(400, f"previous_response_id {previous.response_id} is {previous.status}: only a "
                                       "completed response can be continued", param="previous_response_id",
                                  code="invalid_value")
            for earlier in store.chain(previous):
                history += json.loads(earlier.messages) + output_messages(body_of(earlier)["output"])
            conversation = previous.conversation_id
        chat = chat_request(body, history)
        run = ResponseRun(service, store, body, principal, chat, conversation or new_id("resp").replace("_", "-"))
        if body.background:
            return JSONResponse(await background.start(run, received))
        sub = await run.submit(received, request.headers.get("traceparent"))
        headers = {REQUEST_HEADER: sub.request_id, CONVERSATION_HEADER: sub.conversation_id}
        if body.stream:
            return StreamingResponse(run.events(sub), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            await wait_for_answer(request, service.replies(sub), False)
        except ClientGone:
            service.cancel(sub, "client_disconnected")
            return JSONResponse({}, status_code=499)
        except OpenAIError as exc:
            service.finish(sub, outcome_of(exc))
            raise
        service.finish(sub, "ok")
        return JSONResponse(await run.finished(sub), headers=headers)

    @app.get(ROUTE + "/{response_id}")
    async def retrieve(response_id: str, principal: Principal = Depends(authenticate)) -> JSONResponse:
        return JSONResponse(body_of(await stored_or_404(principal, response_id)))

    @app.delete(ROUTE + "/{response_id}")
    async def delete(response_id: str, principal: Principal = Depends(authenticate)) -> JSONResponse:
        stored = await stored_or_404(principal, response_id)
        await asyncio.to_thread(store.delete, stored)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post(ROUTE + "/{response_id}/cancel")
    async def cancel(response_id: str, principal: Principal = Depends(authenticate)) -> JSONResponse:
        stored = await stored_or_404(principal, response_id)
        body = body_of(stored)
        if not body.get("background"):
            raise OpenAIError(400, "only a background response can be cancelled", param="response_id",
                              code="invalid_value")
        if stored.status in ENDED:
            if stored.status == "cancelled":
                return JSONResponse(body)
            raise OpenAIError(409, f"the response is {stored.status}: there is nothing to cancel",
                              param="response_id", code="response_not_cancellable")
        cancelled = {**body, "status": "cancelled"}
        await asyncio.to_thread(store.publish, replace(stored, status="cancelled", body=json.dumps(cancelled)))
        return JSONResponse(cancelled)

    return background


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(chat_body(body, history))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise OpenAIError(400, f"{where}: {first.get('msg')}", param=where or None, code="invalid_value") from None


class ResponseRun:
    """One response: its chat request submitted, its answer as output items, stored when asked."""

    def __init__(self, service: Any, store: ResponseStore, body: ResponsesRequest, principal: Principal,
                 chat: ChatCompletionRequest, conversation_id: str) -> None:
        self.service, self.store, self.body, self.principal, self.chat = service, store, body, principal, chat
        self.conversation_id = conversation_id
        self.response_id = new_id("resp")
        self.message_id = new_id("msg")
        self.created_at = int(time.time())
        self.user_id = resolve_user(principal, chat.user).user_id  # whose it is: an erasure of them deletes it

    async def submit(self, received: float, traceparent: str | None = None):
        return await self.service.submit(self.principal, self.chat, self.conversation_id, received,
                                         traceparent=traceparent, route=ROUTE)

    def object(self, status: str, output: list[dict[str, Any]], usage_: dict[str, Any] | None = None,
               error: dict[str, Any] | None = None, model: str | None = None) -> dict[str, Any]:
        return response_object(self.response_id, self.body, self.created_at, status, output, usage_, error, model)

    def answer(self, sub: Any) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        choice = sub.choices[0]
        text, calls = choice.message()
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        return status, output_items(text, calls, self.message_id), usage(sub.tokens_in, sub.tokens_out,
                                                                        sub.cached_tokens)

    async def finished(self, sub: Any) -> dict[str, Any]:
        status, output, usage_ = self.answer(sub)
        response = self.object(status, output, usage_, model=sub.model)
        await self.store_it(status, response)
        return response

    async def store_it(self, status: str, response: dict[str, Any]) -> None:
        if self.body.store:
            await asyncio.to_thread(self.store.publish, StoredResponse(
                response_id=self.response_id, tenant=self.principal.tenant, user_id=self.user_id,
                conversation_id=self.conversation_id, previous_response_id=self.body.previous_response_id,
                status=status, messages=json.dumps(input_messages(self.body.input)), body=json.dumps(response)))

    async def events(self, sub: Any) -> AsyncIterator[str]:
        """The streamed response (module docstring); the answer is stored at its end when asked."""
        seq = itertools.count()
        finished = False
        try:
            yield event("response.created", next(seq), response=self.object("in_progress", []))
            yield event("response.in_progress", next(seq), response=self.object("in_progress", []))
            deltas = self.service.replies(sub)
            if not self.chat.tools:
                item = message_item(self.message_id, "", "in_progress")
                yield event("response.output_item.added", next(seq), output_index=0, item=item)
                yield event("response.content_part.added", next(seq), item_id=self.message_id, output_index=0,
                            content_index=0, part=output_text(""))
                async for delta in deltas:
                    if delta.text:
                        yield event("response.output_text.delta", next(seq), item_id=self.message_id, output_index=0,
                                    content_index=0, delta=delta.text, logprobs=[])
            else:
                async for _ in deltas:  # calls are read from the whole answer
                    pass
            self.service.finish(sub, "ok")
            finished = True
            status, output, usage_ = self.answer(sub)
            for index, item in enumerate(output):
                for text in self._item_events(seq, index, item, opened=not self.chat.tools):
                    yield text
            response = self.object(status, output, usage_, model=sub.model)
            await self.store_it(status, response)
            yield event("response.completed", next(seq), response=response)
        except OpenAIError as exc:
            if not finished:
                self.service.finish(sub, outcome_of(exc))
                finished = True
            error = {"code": exc.code or "server_error", "message": exc.message}
            yield event("error", next(seq), code=error["code"], message=error["message"], param=exc.param)
            yield event("response.failed", next(seq), response=self.object("failed", [], error=error))
        finally:
            if not finished:  # Starlette cancelled us: the client went away
                self.service.cancel(sub, "client_disconnected")

    def _item_events(self, seq, index: int, item: dict[str, Any], opened: bool):
        """An item's events from its addition (when not already opened) to its end."""
        if item["type"] == "message":
            text = item["content"][0]["text"]
            if not opened or index > 0:
                yield event("response.output_item.added", next(seq), output_index=index,
                            item=message_item(item["id"], "", "in_progress"))
                yield event("response.content_part.added", next(seq), item_id=item["id"], output_index=index,
                            content_index=0, part=output_text(""))
                if text:
                    yield event("response.output_text.delta", next(seq), item_id=item["id"], output_index=index,
                                content_index=0, delta=text, logprobs=[])
            yield event("response.output_text.done", next(seq), item_id=item["id"], output_index=index,
                        content_index=0, text=text, logprobs=[])
            yield event("response.content_part.done", next(seq), item_id=item["id"], output_index=index,
                        content_index=0, part=output_text(text))
        else:
            yield event("response.output_item.added", next(seq), output_index=index,
                        item={**item, "arguments": "", "status": "in_progress"})
            yield event("response.function_call_arguments.delta", next(seq), item_id=item["id"], output_index=index,
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", next(seq), item_id=item["id"], output_index=index,
                        name=item["name"], arguments=item["arguments"])
        yield event("response.output_item.done", next(seq), output_index=index, item=item)


class BackgroundResponses:
    """The background responses this gateway runs: each a task; a cancel read from the store (any gateway
    may write it) stops its generation."""

    def __init__(self, service: Any, store: ResponseStore) -> None:
        self.service, self.store = service, store
        self.running: dict[str, Any] = {}  # response id -> its submitted request
        self.tasks: set[asyncio.Task] = set()
        self.loop: asyncio.AbstractEventLoop | None = None

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.store.view.on_apply = lambda stored: loop.call_soon_threadsafe(self._cancelled, stored)

    def _cancelled(self, stored: StoredResponse) -> None:
        sub = self.running.get(stored.response_id)
        if sub is not None and stored.status == "cancelled":
            self.service.cancel(sub, "cancelled")

    async def start(self, run: ResponseRun, received: float) -> dict[str, Any]:
        queued = run.object("queued", [])
        await run.store_it("queued", queued)
        task = asyncio.ensure_future(self._run(run, received))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return queued

    async def _run(self, run: ResponseRun, received: float) -> None:
        try:
            sub = await run.submit(received)
        except OpenAIError as exc:
            await run.store_it("failed", run.object("failed", [], error={"code": exc.code, "message": exc.message}))
            return
        self.running[run.response_id] = sub
        try:
            await run.store_it("in_progress", run.object("in_progress", []))
            async for _ in self.service.replies(sub):
                pass
            self.service.finish(sub, "ok")
            await run.finished(sub)  # a cancel stored meanwhile stays (the store's merge)
        except OpenAIError as exc:
            self.service.finish(sub, outcome_of(exc))
            stored = self.store.get(run.response_id, run.principal.tenant)
            if stored is None or stored.status != "cancelled":
                await run.store_it("failed", run.object("failed", [], error={"code": exc.code or "server_error",
                                                                                "message": exc.message}))
        except Exception:
            log.exception("background response %s failed", run.response_id)
            await run.store_it("failed", run.object("failed", [], error={"code": "server_error",
                                                                            "message": "internal error"}))
        finally:
            self.running.pop(run.response_id, None)

    async def close(self) -> None:
        for sub in list(self.running.values()):
            self.service.cancel(sub, "gateway_shutdown")
        for task in list(self.tasks):
            task.cancel()
