"""POST /v1/embeddings: OpenAI's embeddings API, served through Kafka by the streams tier's memory model.

The route checks the body (``EmbeddingsBody.texts``: a string or a list of strings within
``schemas.embeddings.EMBEDDING_LIMITS``; token-id arrays are refused), produces one
``EmbeddingRequest`` to ``chat.embeddings.requests`` (keyed by request id; reply address = this
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
from pydantic import BaseModel, ConfigDict

from gateway.keys import Principal, resolve_user
from gateway.openai_api import OpenAIError
from schemas.embeddings import EMBEDDING_LIMITS, EmbeddingLimits, check_inputs, vector_bytes, vector_floats
from schemas.errors import EncodeError
from schemas.records import EmbeddingRequest, EmbeddingResult, new_id, now_ms
from schemas.requests import LIMITS, RequestRuleError, check_user
from schemas.topics import EMBEDDING_REQUESTS
from transport.errors import DeliveryError
from transport.spans import SERVER

log = logging.getLogger(__name__)
ROUTE = "/v1/embeddings"
ENCODING_FORMATS = ("float", "base64")


class EmbeddingsBody(BaseModel):
    """OpenAI's embeddings request. ``input`` is typed here by hand (``texts``) so that a token-id
    array gets its own clear 400, not pydantic's union error."""

    model_config = ConfigDict(extra="forbid")
    model: str
    input: Any
    encoding_format: str | None = None
    dimensions: int | None = None
    user: str | None = None

    def texts(self, limits: EmbeddingLimits = EMBEDDING_LIMITS) -> list[str]:
        """The texts to embed, in order; OpenAI-shaped 400s for anything else."""
        value = self.input
        if isinstance(value, str):
            texts = [value]
        elif isinstance(value, list):
            if value and all(isinstance(v, int) and not isinstance(v, bool) for v in value) or any(
                    isinstance(v, list) for v in value):
                raise OpenAIError(400, "input as token ids (an array of integers, or of arrays of integers) is not "
                                       "supported: the model's tokenizer is not OpenAI's. Send the text: a string, or "
                                       "a list of strings", param="input", code="invalid_value")
            bad = next((i for i, v in enumerate(value) if not isinstance(v, str)), None)
            if bad is not None:
                raise OpenAIError(400, f"input[{bad}] is {type(value[bad]).__name__}, not a string: send a string or "
                                       "a list of strings", param=f"input[{bad}]", code="invalid_type")
            texts = value
        else:
            raise OpenAIError(400, f"input is {type(value).__name__}: send a string or a list of strings",
                              param="input", code="invalid_type")
        try:
            check_inputs(texts, limits)
        except RequestRuleError as exc:
            raise OpenAIError(400, str(exc), param=exc.field, code=exc.code) from None
        return texts

    def encoding(self) -> str:
        fmt = self.encoding_format or "float"
        if fmt not in ENCODING_FORMATS:
            raise OpenAIError(400, f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}; got {fmt!r}",
                              param="encoding_format", code="invalid_value")
        return fmt

    def check(self) -> None:
        """The rules that need no model: ``dimensions`` positive, ``user`` an id (streams checks the rest)."""
        if self.dimensions is not None and self.dimensions < 1:
            raise OpenAIError(400, f"dimensions must be at least 1, got {self.dimensions}; leave it out for the "
                                   "model's own", param="dimensions", code="invalid_value")
        if self.user:  # "" = no user, as OpenAI's clients send it
            try:
                check_user(self.user, LIMITS)
            except RequestRuleError as exc:
                raise OpenAIError(400, str(exc), param=exc.field, code=exc.code) from None


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

    def admit(self) -> None:
        service = self.service
        held = len(service.pending) + len(self.inflight)
        if held >= service.settings.max_pending:
            service.metrics.requests.labels("rejected_busy").inc()
            raise OpenAIError(429, f"the gateway has {held} requests in flight (limit {service.settings.max_pending}); "
                                   "retry after 1 s", type="rate_limit_error", code="backlog_full",
                              headers={"Retry-After": "1"})

    async def embed(self, principal: Principal, user_id: str, model: str, texts: list[str], dimensions: int | None,
                    traceparent: str | None = None) -> EmbeddingResult:
        """Produce the request, wait for its result (until the deadline); OpenAIError when it failed."""
        service = self.service
        self.admit()
        request_id = new_id()
        created_at = now_ms()
        deadline_at = created_at + round(service.settings.first_chunk_timeout_s * 1000)
        record = EmbeddingRequest(request_id=request_id, tenant=principal.tenant, user_id=user_id,
                                  created_at=created_at, model=model, inputs=texts, dimensions=dimensions,
                                  reply_to=service.reply_topic, reply_partition=0, deadline_at=deadline_at)
        span = service.tracer.start(f"POST {ROUTE}", traceparent, SERVER, {
            "http.request.method": "POST", "http.route": ROUTE, "chatpipe.request_id": request_id,
            "gen_ai.operation.name": "embeddings", "gen_ai.request.model": model,
            "chatpipe.embeddings.inputs": len(texts)}).activate()
        queue = service.reader.register(request_id)
        self.inflight[request_id] = principal.tenant
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


def add_embeddings_route(app: FastAPI, authenticate: Callable[..., Principal], service: Any) -> GatewayEmbeddings:
    """Register POST /v1/embeddings on ``app``; returns the object that serves it (``app.state.embeddings``)."""
    embeddings = GatewayEmbeddings(service)
    app.state.embeddings = embeddings

    @app.post(ROUTE)
    async def create_embeddings(request: Request, body: EmbeddingsBody,
                                principal: Principal = Depends(authenticate)) -> JSONResponse:
        received = time.perf_counter()
        texts = body.texts()
        encoding = body.encoding()
        body.check()
        user = resolve_user(principal, body.user)  # 403 when the key may not name that user
        result = await embeddings.embed(principal, user.user_id, body.model, texts, body.dimensions,
                                        traceparent=request.headers.get("traceparent"))
        log.debug("embeddings: %d vector(s) in %.1f ms", result.count, (time.perf_counter() - received) * 1e3)
        return JSONResponse(response_body(result, encoding))

    return embeddings
