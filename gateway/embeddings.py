"""POST /v1/embeddings: OpenAI's embeddings API, served through Kafka by the streams tier's memory model.

The route has ``translate.embedding_request_to_record`` check the body (``openai_api.EmbeddingsBody``:
a string or a list of strings within ``schemas.embeddings.EMBEDDING_LIMITS``; token-id arrays are
refused) and make its record, then produces that one ``EmbeddingRequest`` to ``chat.embeddings.requests`` (keyed by request id; reply address = this
gateway's reply topic, partition 0; deadline = ``first_chunk_timeout_s`` from now) and waits for
its ``EmbeddingResult`` on the reply topic (``replies.ReplyReader`` hands it to the request's
queue), at most until that deadline (then 504). Streams embeds with the model memory uses
(streams/embedding_requests.py) and checks what only it knows: ``model`` (its served name,
``all-MiniLM-L6-v2`` by default), ``dimensions`` (its vector size; any other is a 400), the
inputs' length in the model's tokens. Its refusals come back as results with an error code,
answered here in OpenAI's shape (``error_of``).

``encoding_format``: ``float`` (the default) answers JSON numbers (each exactly the float32 the
model gave); ``base64`` answers each vector's little-endian float32 bytes in base64, as OpenAI does
(the official Python client asks for base64 unless told otherwise, and decodes it).

Auth and ``user`` as for chat completions: the key decides which user it may name (403 otherwise);
the user is carried on the record for logs, never stored. The requests in flight count towards
the gateway's ``max_pending`` with the chat requests (429 beyond).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import Any, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from gateway.keys import Principal
from gateway.openai_api import EmbeddingsBody, OpenAIError
from gateway.replies import ReplyReaderStopped
from gateway.responses import reader_stopped_error
from gateway.translate import embedding_request_to_record
from schemas.embeddings import vector_bytes, vector_floats
from schemas.errors import EncodeError
from schemas.records import EmbeddingRequest, EmbeddingResult, now_ms
from schemas.topics import EMBEDDING_REQUESTS
from transport.errors import DeliveryError
from transport.spans import SERVER

log = logging.getLogger(__name__)
ROUTE = "/v1/embeddings"


def error_of(result: EmbeddingResult) -> OpenAIError:
    """The HTTP error for a result that says the request was not served."""
    message = result.error or "the embedding request was not served"
    code = result.error_code
    if code == "model_not_found":
        return OpenAIError(404, message, param="model", code="model_not_found")
    if code == "expired":
        return OpenAIError(504, f"the request passed its deadline before it was served: {message}",
                           type="server_error", code="expired")
    if code in ("invalid_value", "invalid_type", "array_above_max_length", "string_above_max_length",
                "context_length_exceeded"):
        return OpenAIError(400, message, param=result.error_param, code=code)
    return OpenAIError(500, message, type="server_error", code=code or "internal_error")


def response_body(result: EmbeddingResult, encoding: str) -> dict[str, Any]:
    """OpenAI's embeddings response for a served result."""
    dim = result.dimensions
    if encoding == "base64":
        embedding = lambda i: base64.b64encode(vector_bytes(result.vectors, dim, i)).decode("ascii")
    else:
        embedding = lambda i: vector_floats(result.vectors, dim, i)
    return {"object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": embedding(i)} for i in range(result.count)],
            "model": result.model,
            "usage": {"prompt_tokens": result.tokens_in, "total_tokens": result.tokens_in}}


class GatewayEmbeddings:
    """The embedding requests of one gateway: produced with the service's producer, answered through
    its reply reader. ``inflight``: request id -> tenant."""

    def __init__(self, service: Any) -> None:
        self.service = service  # gateway.service.GatewayService
        self.inflight: dict[str, str] = {}

    async def embed(self, record: EmbeddingRequest, traceparent: str | None = None) -> EmbeddingResult:
        """Take a slot of the gateway's backlog (429 when full), produce the request
        (``translate.embedding_request_to_record``'s), wait for its result (until its deadline);
        OpenAIError when it failed."""
        service = self.service
        service.check_serving()
        held = len(service.pending) + len(self.inflight)
        if held >= service.settings.max_pending:
            service.metrics.requests.labels("rejected_busy").inc()
            raise OpenAIError(429, f"the gateway has {held} requests in flight (limit {service.settings.max_pending}); "
                                   "retry after 1 s", type="rate_limit_error", code="backlog_full",
                              headers={"Retry-After": "1"})
        request_id, model, texts, deadline_at = record.request_id, record.model, record.inputs, record.deadline_at
        span = service.tracer.start(f"POST {ROUTE}", traceparent, SERVER, {
            "http.request.method": "POST", "http.route": ROUTE, "chatpipe.request_id": request_id,
            "gen_ai.operation.name": "embeddings", "gen_ai.request.model": model,
            "chatpipe.embeddings.inputs": len(texts)}).activate()
        queue = service.reader.register(request_id)
        self.inflight[request_id] = record.tenant
        outcome = "error"
        try:
            try:
                await service.producer.send(service.kafka.topic(EMBEDDING_REQUESTS), record, key=request_id,
                                            parent_trace=span.traceparent)
            except EncodeError as exc:  # e.g. a lone surrogate (valid JSON, not encodable text)
                outcome = "invalid"
                raise OpenAIError(400, f"the request cannot be encoded: {exc}", param="input",
                                  code="invalid_value") from None
            except DeliveryError as exc:
                outcome = "produce_failed"
                raise OpenAIError(503, f"the pipeline did not take the request: {exc}", type="server_error",
                                  code="kafka_unavailable") from None
            timeout = max(0.0, (deadline_at - now_ms()) / 1000)
            while True:
                try:
                    reply = await asyncio.wait_for(queue.get(), timeout)
                except asyncio.TimeoutError:
                    outcome = "timeout"
                    raise OpenAIError(504, f"no answer from the pipeline within "
                                           f"{service.settings.first_chunk_timeout_s:g} s", type="server_error",
                                      code="timeout") from None
                if isinstance(reply, EmbeddingResult):
                    break
                if isinstance(reply, ReplyReaderStopped):
                    outcome = "gateway_unavailable"
                    raise reader_stopped_error(reply)
                log.warning("embedding request %s: a %s on its queue; dropped", request_id, type(reply).__name__)
            if reply.error_code:
                outcome = reply.error_code
                raise error_of(reply)
            if reply.count != len(texts):
                raise OpenAIError(500, f"the pipeline answered {reply.count} vectors for {len(texts)} inputs",
                                  type="server_error", code="internal_error")
            outcome = "ok"
            span.update({"gen_ai.usage.input_tokens": reply.tokens_in})
            return reply
        finally:
            service.reader.unregister(request_id)
            self.inflight.pop(request_id, None)
            span.set("chatpipe.outcome", outcome)
            if outcome != "ok":
                span.fail(outcome)
            span.end()


def add_embeddings_route(app: FastAPI, authenticate: Callable[..., Principal], service: Any) -> None:
    """Register POST /v1/embeddings on ``app``, served by a ``GatewayEmbeddings`` (``app.state.embeddings``)."""
    app.state.embeddings = embeddings = GatewayEmbeddings(service)

    @app.post(ROUTE)
    async def create_embeddings(request: Request, body: EmbeddingsBody,
                                principal: Principal = Depends(authenticate)) -> JSONResponse:
        received = time.perf_counter()
        record = embedding_request_to_record(body, principal, service.settings, reply_to=service.reply_topic)
        result = await embeddings.embed(record, traceparent=request.headers.get("traceparent"))
        log.debug("embeddings: %d vector(s) in %.1f ms", result.count, (time.perf_counter() - received) * 1e3)
        return JSONResponse(response_body(result, body.encoding()))
