"""Server-sent events of OpenAI's streaming chat API, parsed and folded into one answer.

Pure functions over text lines (no HTTP here), so the parser is tested on literal streams.
Follows the SSE spec as far as OpenAI-style servers use it: ``data:`` lines (several in one
event are joined with newlines), ``:`` comment lines (keep-alives) ignored, a blank line ends an
event, ``data: [DONE]`` ends the stream. A hand-written parser rather than a library: it is these
twenty lines, and httpx already splits the lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from schemas.errors import ChatpipeError

DONE = "[DONE]"


class StreamError(ChatpipeError):
    """The stream broke the protocol (bad JSON) or carried an error object mid-way."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


def sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The ``data`` of each event in ``lines`` (lines without their line endings)."""
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
        # other fields (event, id, retry) carry nothing an OpenAI stream needs
    if data:  # a stream cut without its final blank line still delivers its last event
        yield "\n".join(data)


def chunks(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of a stream, until ``[DONE]``; an error object raises."""
    for data in sse_data(lines):
        if data.strip() == DONE:
            return
        try:
            obj = json.loads(data)
        except ValueError as exc:
            raise StreamError(f"the gateway sent an event that is not JSON: {data[:80]!r}") from exc
        if isinstance(obj, dict) and "error" in obj:
            err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
            raise StreamError(err.get("message") or "error in stream", code=err.get("code"))
        yield obj


@dataclass
class StreamedAnswer:
    """What one streamed completion added up to."""

    text: str = ""
    completion_id: str | None = None
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    content_chunks: int = 0  # chunks that carried text: one per token or a few, by the server's choice

    def add(self, chunk: dict[str, Any]) -> str:
        """Fold ``chunk`` in; returns the new text it carries ('' if none)."""
        self.completion_id = chunk.get("id") or self.completion_id
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        piece = ""
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            piece += delta.get("content") or ""
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if piece:
            self.text += piece
            self.content_chunks += 1
        return piece

    @property
    def completion_tokens(self) -> int:
        """Tokens generated: the server's usage count, else the number of text chunks."""
        if self.usage and self.usage.get("completion_tokens") is not None:
            return int(self.usage["completion_tokens"])
        return self.content_chunks
