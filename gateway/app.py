"""The gateway's HTTP routes (FastAPI): OpenAI's chat completions, models, health, metrics, feedback;
the other routes are added from their modules (completions, embeddings, erasure, files, batches), and
the batch runner runs beside them (batch_runner.py).

A streamed request waits for its first chunk before the HTTP status is sent, so a request the
pipeline refuses (context too long, invalid) gets a proper 4xx with OpenAI's error body, not a
200 stream that breaks. Until then a task watches for the client going away; afterwards
Starlette cancels the stream when it does. Either way a ``Cancel`` reaches the worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, AsyncIterator, Iterator

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.batch_runner import BatchRunner
from gateway.batches import add_batch_routes
from gateway.completions import add_completion_routes
from gateway.embeddings import add_embeddings_route
from gateway.erasure import add_erasure_routes
from gateway.keys import KeyStore, Principal
from gateway.files import MULTIPART_OVERHEAD_BYTES, add_file_routes
from gateway.files import ROUTE as FILES_ROUTE
from gateway.limits import BodySizeLimit, RouteLimit
from gateway.responses_routes import add_response_routes
from gateway.metrics import GatewayMetrics
from gateway.openai_api import ChatCompletionRequest, OpenAIError
from gateway.responses import choice, chunk, completion, sse, usage
from gateway.service import Delta, GatewayService, Submitted
from gateway.settings import GatewaySettings
from gateway.translate import (CACHE_HEADER, MEMORY_HEADER, TIMEOUT_HEADER, cache_header, client_timeout_s,
                               memory_header)
from gateway.streaming import (CONVERSATION_HEADER, REQUEST_HEADER, ClientGone, cache_headers, outcome_of,
                               wait_for_answer)
from schemas.records import FeedbackKind
from transport.batch_book import BatchBook, BatchWriter
from transport.response_store import ResponseStore
from transport.settings import KafkaSettings

log = logging.getLogger(__name__)


class FeedbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str
    conversation_id: str
    kind: str  # thumbs_up | thumbs_down | regenerate | edit
    edited_text: str | None = None
    comment: str | None = None
    user: str | None = None


def create_app(kafka: KafkaSettings, settings: GatewaySettings, keys: KeyStore) -> FastAPI:
    metrics = GatewayMetrics()
    service = GatewayService(kafka, settings, metrics)
    batches = BatchBook(kafka)  # every batch's state (chat.batches), for any replica's GET
    stored_responses = ResponseStore(kafka)  # the Responses API's stored responses (chat.api.responses)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start()
        loop = asyncio.get_running_loop()
        await asyncio.to_thread(batches.start, lambda exc: loop.call_soon_threadsafe(service.on_failure, exc))
        await asyncio.to_thread(stored_responses.start, lambda exc: loop.call_soon_threadsafe(service.on_failure, exc))
        background.watch(loop)
        writer = app.state.batch_writer = BatchWriter(kafka)
        runner = BatchRunner(kafka, service, batches, writer, app.state.files, keys, app)
        runner.start()  # runs the batches of the chat.batches partitions its consumer group gives it
        yield
        await runner.close()
        await background.close()
        batches.close()
        await asyncio.to_thread(stored_responses.close)
        await service.close()
        await asyncio.to_thread(writer.close)

    app = FastAPI(title="chatpipe gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service
    # 413 before a big body is parsed; an upload has the files' limit (plus the multipart framing)
    upload_limit = RouteLimit(settings.max_file_bytes + MULTIPART_OVERHEAD_BYTES, "CHATPIPE_GATEWAY_MAX_FILE_BYTES",
                              "file", "Split the file into several batches")
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes, routes={FILES_ROUTE: upload_limit})

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        code = None
        if first.get("type") == "json_invalid" or (not loc and first.get("type") == "model_attributes_type"):
            message, param = "the request body must be a JSON object (Content-Type: application/json)", None
        elif first.get("type") == "extra_forbidden":  # OpenAI's own words for a field it does not know
            param, code = ".".join(loc), "unknown_parameter"
            message = (f"Unrecognized request argument supplied: {param}. docs/gateway.md lists the fields this route "
                       "takes (for chat completions: \"Request fields\", which are honoured, refused or ignored)")
        else:
            message, param = f"{'.'.join(loc) or 'body'}: {first.get('msg')}", ".".join(loc) or None
        return await openai_error(request, OpenAIError(400, message, param=param, code=code))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")  # a bug: logged with its traceback, answered in OpenAI's shape
        return await openai_error(request, OpenAIError(500, f"internal error: {type(exc).__name__}",
                                                       type="server_error", code="internal_error"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return await openai_error(request, OpenAIError(exc.status_code, str(exc.detail), type=kind))

    def authenticate(authorization: str | None = Header(None)) -> Principal:
        principal = keys.lookup(authorization)
        if principal is None:
            given = "You didn't provide an API key" if not authorization else "Incorrect API key provided"
            raise OpenAIError(401, f"{given}. Pass it as 'Authorization: Bearer <key>' (keys file: "
                                   f"{settings.keys_file}).", code="invalid_api_key")
        return principal

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        status = "ok" if service.ready else "failed" if service.failure is not None else "starting"
        body = {"status": status, "gateway_id": service.gateway_id,
                "reply_topic": service.reply_topic, "pending": len(service.pending),
                # serving workers per model, as their reports say (admission's view: transport/fleet.py)
                "workers": {model: len(service.fleet.serving(model)) for model in settings.models}}
        return JSONResponse(body, status_code=200 if service.ready else 503)

    @app.get("/metrics")
    async def metrics_text() -> PlainTextResponse:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(principal: Principal = Depends(authenticate)) -> dict[str, Any]:
        # the base models, then the key's tenant's CANARY/LIVE versions and its aliases (chat.models)
        return {"object": "list", "data": service.models.listing(principal.tenant, settings.models)}

    add_erasure_routes(app, authenticate, service)  # DELETE /v1/users/{user}[...], /v1/conversations/{id}
    add_embeddings_route(app, authenticate, service)  # POST /v1/embeddings (gateway/embeddings.py)
    add_completion_routes(app, authenticate, service)  # POST /v1/completions (completions.py)
    app.state.files = add_file_routes(app, authenticate, service)  # /v1/files (files.py)
    # /v1/batches (batches.py); the writer is made at start (it needs the broker)
    add_batch_routes(app, authenticate, service, app.state.files, batches, lambda: app.state.batch_writer)
    background = add_response_routes(app, authenticate, service, stored_responses)  # /v1/responses

    @app.post("/v1/feedback", status_code=202)
    async def feedback(body: FeedbackBody, principal: Principal = Depends(authenticate)) -> dict[str, str]:
        try:
            kind = FeedbackKind(body.kind.upper())
        except ValueError:
            raise OpenAIError(400, f"kind must be one of {', '.join(k.value.lower() for k in FeedbackKind)}; "
                                   f"got {body.kind!r}", param="kind") from None
        if kind is FeedbackKind.EDIT and not (body.edited_text or "").strip():
            raise OpenAIError(400, "an edit needs edited_text", param="edited_text")
        # Only the key's own requests (service.feedback checks the request id's MAC: 404 otherwise);
        # the completion id (chatcmpl-<request id>) is taken as well as the bare request id.
        event_id = await service.feedback(principal, request_id=body.request_id.removeprefix("chatcmpl-"),
                                          conversation_id=body.conversation_id, kind=kind,
                                          edited_text=body.edited_text, comment=body.comment, user=body.user)
        return {"event_id": event_id}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest,
                               principal: Principal = Depends(authenticate)):
        received = time.perf_counter()
        sub = await service.submit(principal, body, request.headers.get(CONVERSATION_HEADER), received,
                                   traceparent=request.headers.get("traceparent"),
                                   timeout_s=client_timeout_s(request.headers.get(TIMEOUT_HEADER)),
                                   cache=cache_header(request.headers.get(CACHE_HEADER)),
                                   memory=memory_header(request.headers.get(MEMORY_HEADER)))
        headers = {CONVERSATION_HEADER: sub.conversation_id, REQUEST_HEADER: sub.request_id}
        deltas = service.replies(sub)
        try:
            first = await wait_for_answer(request, deltas, body.stream)
        except ClientGone:
            service.cancel(sub, "client_disconnected")
            return PlainTextResponse("", status_code=499)
        except OpenAIError as exc:
            service.finish(sub, outcome_of(exc))
            raise
        headers |= cache_headers([sub])  # streamed: as the chunks up to the first event say
        if not body.stream:
            service.finish(sub, "ok")
            choices = [choice(c.index, c.message()[0], c.finish_reason, c.logprobs, c.message()[1])
                       for c in sub.choices]
            return JSONResponse(completion(sub.request_id, sub.model, choices, sub.tokens_in, sub.tokens_out,
                                           sub.created, sub.service_tier, sub.cached_tokens), headers=headers)
        return StreamingResponse(events(service, sub, first, deltas, body.include_usage), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


async def events(service: GatewayService, sub: Submitted, first: Delta | None, deltas: AsyncIterator[Delta],
                 include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: each choice's role, its text deltas (with their tokens' logprobs when asked),
    its finish reason; usage when asked (all choices' tokens), once every choice ended; ``[DONE]``."""
    finished = False
    sub_chunk = partial(chunk, sub.request_id, sub.model, sub.created, service_tier=sub.service_tier)  # of this request

    def event(delta: Delta) -> Iterator[str]:
        if delta.parts is not None:  # tools: content and tool_calls deltas (the logprobs on the first)
            parts = delta.parts or ([{}] if delta.logprobs else [])
            for i, part in enumerate(parts):
                yield sub_chunk(index=delta.index, delta=part, logprobs=delta.logprobs if i == 0 else None)
        elif delta.text or delta.logprobs:
            yield sub_chunk(index=delta.index, delta={"content": delta.text}, logprobs=delta.logprobs)
        if delta.finish_reason is not None:
            yield sub_chunk(index=delta.index, finish_reason=delta.finish_reason)

    try:
        for c in sub.choices:
            yield sub_chunk(index=c.index, delta={"role": "assistant", "content": ""})
        if first is not None:
            for text in event(first):
                yield text
        async for delta in deltas:
            for text in event(delta):
                yield text
        if include_usage:
            yield sub_chunk(usage_=usage(sub.tokens_in, sub.tokens_out, sub.cached_tokens))
        yield sse("[DONE]")
        finished = True
        service.finish(sub, "ok")
    except OpenAIError as exc:  # the pipeline failed mid-stream: OpenAI sends the error as an event
        yield sse(exc.body())
        yield sse("[DONE]")
        finished = True
        service.finish(sub, outcome_of(exc))
    finally:
        if not finished:  # Starlette cancelled us: the client went away
            service.cancel(sub, "client_disconnected")
