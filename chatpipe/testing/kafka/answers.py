"""Reader-side helper of the tests: rebuild each serving attempt's full text from its token chunks.

A test that reads everything the workers wrote (chatpipe/testing/worker.py) keeps the first Response
of a request and compares it with the chunks of the same serving attempt. The gateway does this job
its own way: it shows one request's answer as it streams (``transport.dedupe.AnswerText``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Attempt:
    parts: dict[int, str] = field(default_factory=dict)
    final_index: int | None = None

    @property
    def complete(self) -> bool:
        return self.final_index is not None and all(i in self.parts for i in range(self.final_index + 1))

    @property
    def text(self) -> str:
        return "".join(self.parts[i] for i in sorted(self.parts))


class StreamAssembler:
    """Token chunks in, text per (request_id, attempt) out; duplicates of a chunk are harmless."""

    def __init__(self) -> None:
        self._attempts: dict[tuple[str, str | None], _Attempt] = {}

    def add(self, chunk: Any, attempt: str | None) -> None:
        state = self._attempts.setdefault((chunk.request_id, attempt), _Attempt())
        state.parts[chunk.index] = chunk.text
        if chunk.is_final:
            state.final_index = chunk.index

    def text(self, request_id: str, attempt: str | None) -> str | None:
        """The assembled text of that attempt, or None until its final chunk (and all before) came."""
        state = self._attempts.get((request_id, attempt))
        return state.text if state is not None and state.complete else None

    def text_without_gaps(self, request_id: str, attempt: str | None) -> str | None:
        """The text of that attempt's chunks from index 0 up to the first missing one, end marker or
        not: all a kept Response's text is durable before it, its end marker only after it (a
        worker killed in between leaves the attempt without one; docs/worker.md)."""
        state = self._attempts.get((request_id, attempt))
        if state is None:
            return None
        parts = []
        while len(parts) in state.parts:
            parts.append(state.parts[len(parts)])
        return "".join(parts)
