"""A Batch API input file, read and checked as a whole before any line runs (as OpenAI does: one bad line
fails the batch, and the batch's ``errors`` name each bad line's number).

A line is ``{"custom_id", "method": "POST", "url", "body"}``: ``custom_id`` a string unique in the file,
``url`` the batch's endpoint, ``body`` what that endpoint takes (checked with the endpoint's own request
model, so a field the endpoint would refuse fails the batch here instead of every line failing later;
``stream: true`` is refused: a batch's answers are stored, not streamed). What the model and the pipeline
decide (the model being served, the context) is the line's answer, an error line if it comes to that.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from gateway.openai_api import ChatCompletionRequest, CompletionRequest, EmbeddingsBody
from schemas.records import BatchError

#: The endpoints a batch may run, and the request model each line's body must fit.
ENDPOINTS: dict[str, type[BaseModel]] = {"/v1/chat/completions": ChatCompletionRequest,
                                         "/v1/completions": CompletionRequest, "/v1/embeddings": EmbeddingsBody}
MAX_CUSTOM_ID_CHARS = 512
MAX_ERRORS = 100  # errors named in a failed batch; the count says how many more


@dataclass(frozen=True)
class BatchLine:
    number: int  # 1-based line of the file
    custom_id: str
    body: dict[str, Any]


def read_lines(data: bytes, endpoint: str) -> tuple[list[BatchLine], list[BatchError]]:
    """The file's requests, or (when any line is bad) the errors, each naming its line."""
    model = ENDPOINTS[endpoint]
    lines: list[BatchLine] = []
    errors: list[BatchError] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            line = _line(number, raw, endpoint, model, seen)
        except _Bad as bad:
            errors.append(BatchError(code=bad.code, message=f"line {number}: {bad.message}", param=bad.param,
                                     line=number))
            continue
        seen[line.custom_id] = number
        lines.append(line)
    if not lines and not errors:
        errors.append(BatchError(code="empty_file", message="the input file holds no requests"))
    if len(errors) > MAX_ERRORS:
        more = len(errors) - MAX_ERRORS
        errors = errors[:MAX_ERRORS] + [BatchError(code="too_many_errors", message=f"and {more} more bad lines")]
    return lines, errors


class _Bad(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def _line(number: int, raw: bytes, endpoint: str, model: type[BaseModel], seen: dict[str, int]) -> BatchLine:
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _Bad("invalid_json_line", f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise _Bad("invalid_json_line", "not a JSON object")
    unknown = sorted(set(value) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise _Bad("invalid_request", f"unknown field(s) {', '.join(unknown)}; a line has custom_id, method, url, "
                                      "body", param=unknown[0])
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise _Bad("invalid_custom_id", f"custom_id must be a string of 1-{MAX_CUSTOM_ID_CHARS} characters",
                   param="custom_id")
    if custom_id in seen:
        raise _Bad("duplicate_custom_id", f"custom_id {custom_id!r} is on line {seen[custom_id]} already",
                   param="custom_id")
    if value.get("method") != "POST":
        raise _Bad("invalid_method", f"method must be POST, got {value.get('method')!r}", param="method")
    if value.get("url") != endpoint:
        raise _Bad("mismatched_url", f"url {value.get('url')!r} is not the batch's endpoint {endpoint}", param="url")
    body = value.get("body")
    if not isinstance(body, dict):
        raise _Bad("invalid_body", "body must be a JSON object (the endpoint's request)", param="body")
    if body.get("stream"):
        raise _Bad("invalid_body", "stream is not supported in a batch (its answers are stored)", param="body.stream")
    try:
        model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise _Bad("invalid_body", f"body{'.' + where if where else ''}: {first.get('msg')}",
                   param=f"body.{where}" if where else "body") from None
    return BatchLine(number, custom_id, body)
