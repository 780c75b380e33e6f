"""OpenAI's Batch API: ``POST /v1/batches``, ``GET /v1/batches/{id}``, ``GET /v1/batches``,
``POST /v1/batches/{id}/cancel``.

A batch is made from an uploaded file (``files.py``) of the key's tenant: the file is read and checked
whole at once (``batch_lines.read_lines``); a bad line fails the batch, its ``errors`` naming each bad
line (OpenAI's way), else it is ``in_progress`` with its window's end. Its state is a ``BatchJob`` on
``chat.batches`` that every gateway follows (``transport/batch_book.py``), so any replica answers for
any batch, and the gateway whose runner owns its partition runs it (``batch_runner.py``). A batch is its
tenant's: another tenant's id is 404, as for one that never existed.

Reference: https://platform.openai.com/docs/api-reference/batch (objects, statuses, fields).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import replace
from typing import Any, Callable

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway.batch_lines import ENDPOINTS, read_lines
from gateway.keys import Principal, key_fingerprint
from gateway.openai_api import OpenAIError
from gateway.route_spans import route_span, traced
from schemas.records import BatchJob, BatchStatus
from transport.batch_book import ENDED, BatchBook, BatchWriter
from transport.file_store import FileStore, FileStoreError

ROUTE = "/v1/batches"
COMPLETION_WINDOWS = ("24h",)
READ_YOUR_WRITE_S = 3.0  # how long a GET waits for a batch another replica has just made


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)
    output_expires_after: dict[str, Any] | None = None  # accepted: output files are kept until deleted


def batch_object(job: BatchJob) -> dict[str, Any]:
    """OpenAI's ``batch`` object."""
    return {
        "id": job.batch_id, "object": "batch", "endpoint": job.endpoint, "model": None,
        "errors": {"object": "list", "data": [{"code": e.code, "message": e.message, "param": e.param,
                                               "line": e.line} for e in job.errors]} if job.errors else None,
        "input_file_id": job.input_file_id, "completion_window": job.completion_window,
        "status": job.status.value.lower(), "output_file_id": job.output_file_id, "error_file_id": job.error_file_id,
        "created_at": job.created_at, "in_progress_at": job.in_progress_at, "expires_at": job.expires_at,
        "finalizing_at": job.finalizing_at, "completed_at": job.completed_at, "failed_at": job.failed_at,
        "expired_at": job.expired_at, "cancelling_at": job.cancelling_at, "cancelled_at": job.cancelled_at,
        "request_counts": {"total": job.total, "completed": job.completed, "failed": job.failed},
        "metadata": job.metadata or None,
        "usage": {"input_tokens": job.input_tokens, "input_tokens_details": {"cached_tokens": job.cached_tokens},
                  "output_tokens": job.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": job.input_tokens + job.output_tokens},
    }


def add_batch_routes(app: FastAPI, authenticate: Callable[..., Principal], service: Any, store: FileStore,
                     book: BatchBook, writer: Callable[[], BatchWriter]) -> None:
    """``writer()``: the gateway's batch writer (made once the gateway has started)."""
    settings = service.settings

    async def found(principal: Principal, batch_id: str) -> BatchJob:
        job = await asyncio.to_thread(book.wait_for, batch_id, principal.tenant, READ_YOUR_WRITE_S)
        if job is None:  # another tenant's id is answered as one that never existed
            raise OpenAIError(404, f"No batch found with id '{batch_id}'", param="batch_id", code="batch_not_found")
        return job

    @app.post(ROUTE)
    async def create(request: Request, body: CreateBatch, principal: Principal = Depends(authenticate),
                     authorization: str = Header(...)) -> JSONResponse:
        if body.endpoint not in ENDPOINTS:
            raise OpenAIError(400, f"endpoint {body.endpoint!r} is not one a batch runs here: "
                                   f"{', '.join(ENDPOINTS)}", param="endpoint", code="invalid_value")
        if body.completion_window not in COMPLETION_WINDOWS:
            raise OpenAIError(400, f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}",
                              param="completion_window", code="invalid_value")
        for k, v in (body.metadata or {}).items():
            if len(k) > 64 or len(v) > 512:
                raise OpenAIError(400, "metadata keys are at most 64 characters and values at most 512",
                                  param="metadata", code="invalid_value")
        span = route_span(service, "POST", ROUTE, request, principal)

        async def make() -> BatchJob:
            stored = await asyncio.to_thread(store.get, principal.tenant, body.input_file_id)
            if stored is None:
                raise OpenAIError(404, f"No such File object: {body.input_file_id}", param="input_file_id",
                                  code="file_not_found")
            if stored.purpose != "batch":
                raise OpenAIError(400, f"the input file's purpose is {stored.purpose}, not batch",
                                  param="input_file_id", code="invalid_value")
            try:
                data = await asyncio.to_thread(store.read, principal.tenant, body.input_file_id)
            except FileStoreError:
                raise OpenAIError(404, f"No such File object: {body.input_file_id}", param="input_file_id",
                                  code="file_not_found") from None
            lines, errors = read_lines(data, body.endpoint)
            now = int(time.time())
            job = BatchJob(batch_id=f"batch_{secrets.token_hex(12)}", tenant=principal.tenant,
                           key_fingerprint=key_fingerprint(authorization[7:].strip()), input_file_id=stored.id,
                           endpoint=body.endpoint, completion_window=body.completion_window,
                           metadata=body.metadata or {}, total=len(lines), created_at=now)
            if errors:
                job = replace(job, errors=errors, failed_at=now, total=0)
            else:
                job = replace(job, in_progress_at=now, expires_at=now + int(settings.batch_window_s))
            await asyncio.to_thread(writer().publish, job)
            span.update({"chatpipe.batch.id": job.batch_id, "chatpipe.batch.lines": len(lines)})
            return book.apply(job)

        return JSONResponse(batch_object(await traced(span, make)))

    @app.get(ROUTE + "/{batch_id}")
    async def retrieve(request: Request, batch_id: str, principal: Principal = Depends(authenticate)) -> JSONResponse:
        span = route_span(service, "GET", ROUTE + "/{batch_id}", request, principal)
        return JSONResponse(batch_object(await traced(span, lambda: found(principal, batch_id))))

    @app.get(ROUTE)
    async def list_batches(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100),
                           principal: Principal = Depends(authenticate)) -> JSONResponse:
        jobs = book.jobs(principal.tenant)  # newest first
        if after is not None:
            ids = [j.batch_id for j in jobs]
            jobs = jobs[ids.index(after) + 1:] if after in ids else []
        shown = jobs[:limit]
        return JSONResponse({"object": "list", "data": [batch_object(j) for j in shown],
                             "first_id": shown[0].batch_id if shown else None,
                             "last_id": shown[-1].batch_id if shown else None, "has_more": len(jobs) > limit})

    @app.post(ROUTE + "/{batch_id}/cancel")
    async def cancel(request: Request, batch_id: str, principal: Principal = Depends(authenticate)) -> JSONResponse:
        span = route_span(service, "POST", ROUTE + "/{batch_id}/cancel", request, principal)

        async def ask() -> BatchJob:
            job = await found(principal, batch_id)
            if job.status in ENDED:
                raise OpenAIError(409, f"the batch is {job.status.value.lower()}: there is nothing to cancel",
                                  param="batch_id", code="batch_not_cancellable")
            if job.status is BatchStatus.CANCELLING:
                return job
            asked = replace(job, cancelling_at=int(time.time()))
            await asyncio.to_thread(writer().publish, asked)
            return book.apply(asked)

        return JSONResponse(batch_object(await traced(span, ask)))
