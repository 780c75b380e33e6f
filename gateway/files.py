"""OpenAI's Files API: ``POST /v1/files`` (multipart), ``GET /v1/files``, ``GET /v1/files/{id}``,
``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``.

Files are a tenant's: kept under the key's tenant in the file store (``transport/file_store.py``, a
folder or any fsspec URI every replica shares, ``files_uri``), so a key of another tenant gets 404
for an id it did not upload, as for one that never existed. Uploads take purpose ``batch`` (the Batch
API's input; ``batch_output`` files are the pipeline's own); a ``batch`` file must be JSON lines:
each non-empty line a JSON object, at most ``max_file_lines`` of them, the whole at most
``max_file_bytes`` (OpenAI's limits: 200 MB, 50,000 requests). What a line must hold to be a request
is checked when a batch is created from the file, as OpenAI does.

The body limit of the other routes (``max_body_bytes``) does not apply to an upload: ``limits.py``
holds ``/v1/files`` to ``max_file_bytes`` plus the multipart framing. FastAPI spools the upload to a
temporary file (python-multipart), so a large file is not held in memory; it is read twice, once to
check it and once into the store.

Reference: https://platform.openai.com/docs/api-reference/files (objects, fields, list pagination).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable, Iterator, Literal

from fastapi import Depends, FastAPI, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse, Response

from gateway.keys import Principal
from gateway.openai_api import OpenAIError
from gateway.route_spans import route_span, traced
from transport.file_store import FileStore, FileStoreError, StoredFile

ROUTE = "/v1/files"
UPLOAD_PURPOSES = ("batch",)  # what a client may upload; batch_output files are written by the pipeline
#: OpenAI's bounds on ``expires_after[seconds]`` (one hour to 30 days).
EXPIRES_AFTER_S = (3600, 2_592_000)
#: Room for the multipart framing around the file in the body limit (``limits.py``).
MULTIPART_OVERHEAD_BYTES = 64 * 1024
_CHUNK = 1 << 20


def check_batch_lines(lines: Iterator[bytes], max_lines: int) -> int:
    """Count the JSON-lines requests of an upload; ``OpenAIError`` 400 naming the first line that is not
    UTF-8 JSON object text, or the line past ``max_lines``; blank lines are skipped, as OpenAI does."""
    count = 0
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        count += 1
        if count > max_lines:
            raise OpenAIError(400, f"the file has more than {max_lines} requests (line {number}); a batch takes at "
                                   f"most {max_lines} (CHATPIPE_GATEWAY_MAX_FILE_LINES): split it",
                              param="file", code="too_many_lines")
        try:
            value = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise OpenAIError(400, f"line {number} of the file is not JSON: {exc}", param="file",
                              code="invalid_file_format") from None
        if not isinstance(value, dict):
            raise OpenAIError(400, f"line {number} of the file is not a JSON object (one request per line)",
                              param="file", code="invalid_file_format")
    if count == 0:
        raise OpenAIError(400, "the file holds no requests (JSON lines, one request per line)", param="file",
                          code="empty_file")
    return count


def add_file_routes(app: FastAPI, authenticate: Callable[..., Principal], service: Any) -> FileStore:
    """Register the Files API on ``app``; returns its store (the Batch API reads and writes it too)."""
    settings = service.settings
    store = FileStore(settings.files_store())
    metrics = service.metrics

    async def run(operation: str, span, work: Callable[[], Any]) -> Any:
        """``work`` (blocking: the store) in a thread; counted and traced by outcome."""
        return await traced(span, lambda: asyncio.to_thread(work),
                                 lambda outcome: metrics.files.labels(operation, outcome).inc())

    def found(principal: Principal, file_id: str) -> StoredFile:
        stored = store.get(principal.tenant, file_id)
        if stored is None:  # another tenant's id is answered as one that never existed
            raise OpenAIError(404, f"No such File object: {file_id}", param="id", code="file_not_found")
        return stored

    @app.post(ROUTE)
    async def upload(request: Request, file: UploadFile, purpose: str = Form(...),
                     expires_anchor: str | None = Form(None, alias="expires_after[anchor]"),
                     expires_seconds: int | None = Form(None, alias="expires_after[seconds]"),
                     principal: Principal = Depends(authenticate)) -> JSONResponse:
        if purpose not in UPLOAD_PURPOSES:
            raise OpenAIError(400, f"purpose {purpose!r} is not taken here: this gateway keeps files for the Batch "
                                   f"API (purpose 'batch'); docs/gateway.md", param="purpose", code="invalid_value")
        expires_after_s = _expires_after(expires_anchor, expires_seconds)
        span = route_span(service, "POST", ROUTE, request, principal)

        def check_and_store() -> StoredFile:
            source = file.file
            size = source.seek(0, 2)
            if size > settings.max_file_bytes:
                raise OpenAIError(413, f"the file is {size} bytes; this gateway takes files of at most "
                                       f"{settings.max_file_bytes} bytes (CHATPIPE_GATEWAY_MAX_FILE_BYTES)",
                                  param="file", code="file_too_large")
            source.seek(0)
            lines = check_batch_lines(iter(source.readline, b""), settings.max_file_lines)
            source.seek(0)
            stored = store.put(principal.tenant, file.filename or "upload.jsonl", purpose,
                               iter(lambda: source.read(_CHUNK), b""), expires_after_s)
            span.update({"chatpipe.file.id": stored.id, "chatpipe.file.bytes": stored.bytes,
                         "chatpipe.file.lines": lines})
            return stored

        try:
            stored = await run("upload", span, check_and_store)
        finally:
            await file.close()
        metrics.file_bytes.inc(stored.bytes)
        return JSONResponse(stored.openai())

    @app.get(ROUTE)
    async def list_files(request: Request, purpose: str | None = None,
                         limit: int = Query(10_000, ge=1, le=10_000), order: Literal["asc", "desc"] = "desc",
                         after: str | None = None, principal: Principal = Depends(authenticate)) -> JSONResponse:
        span = route_span(service, "GET", ROUTE, request, principal)

        def page() -> dict[str, Any]:
            files = store.list(principal.tenant, purpose)  # newest first
            if order == "asc":
                files.reverse()
            if after is not None:
                ids = [f.id for f in files]
                files = files[ids.index(after) + 1:] if after in ids else []
            shown = files[:limit]
            return {"object": "list", "data": [f.openai() for f in shown],
                    "first_id": shown[0].id if shown else None, "last_id": shown[-1].id if shown else None,
                    "has_more": len(files) > limit}

        return JSONResponse(await run("list", span, page))

    @app.get(ROUTE + "/{file_id}")
    async def retrieve(request: Request, file_id: str, principal: Principal = Depends(authenticate)) -> JSONResponse:
        span = route_span(service, "GET", ROUTE + "/{file_id}", request, principal)
        return JSONResponse(await run("retrieve", span, lambda: found(principal, file_id).openai()))

    @app.get(ROUTE + "/{file_id}/content")
    async def content(request: Request, file_id: str, principal: Principal = Depends(authenticate)) -> Response:
        span = route_span(service, "GET", ROUTE + "/{file_id}/content", request, principal)

        def read() -> bytes:
            found(principal, file_id)
            try:
                return store.read(principal.tenant, file_id)
            except FileStoreError:  # deleted between the two reads
                raise OpenAIError(404, f"No such File object: {file_id}", param="id", code="file_not_found") from None

        return Response(await run("content", span, read), media_type="application/octet-stream")

    @app.delete(ROUTE + "/{file_id}")
    async def delete(request: Request, file_id: str, principal: Principal = Depends(authenticate)) -> JSONResponse:
        span = route_span(service, "DELETE", ROUTE + "/{file_id}", request, principal)

        def remove() -> dict[str, Any]:
            if not store.delete(principal.tenant, file_id):
                raise OpenAIError(404, f"No such File object: {file_id}", param="id", code="file_not_found")
            return {"id": file_id, "object": "file", "deleted": True}

        return JSONResponse(await run("delete", span, remove))

    return store


def _expires_after(anchor: str | None, seconds: int | None) -> int | None:
    """``expires_after[anchor]`` / ``[seconds]`` (OpenAI's): seconds after creation, or None (kept)."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at" or seconds is None:
        raise OpenAIError(400, "expires_after needs anchor 'created_at' and seconds", param="expires_after",
                          code="invalid_value")
    low, high = EXPIRES_AFTER_S
    if not low <= seconds <= high:
        raise OpenAIError(400, f"expires_after[seconds] must be between {low} and {high}; got {seconds}",
                          param="expires_after", code="invalid_value")
    return seconds
