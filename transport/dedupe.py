"""Serving attempts: the header that names one, and the text a reader shows across them.

Delivery is at-least-once: an inference worker that crashes mid-answer (or after its Response is
durable but before the request's input is committed) has the request served again by another
worker, a new *attempt* whose chunks start again at index 0 and, after sampling, may say
something else. Every record of an attempt (its token chunks and its Response) carries the header
``chatpipe-attempt`` (:data:`ATTEMPT_HEADER`, written by the worker, read by :func:`attempt_of`).

:class:`AnswerText` is the reader's rule for one request's chunks, used by the gateway: the newest
attempt wins and what was already shown is not shown again.

Not here: remembering which Responses were recorded (streams keeps that per conversation, in its
changelog-backed table, so it survives a restart).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ATTEMPT_HEADER = "chatpipe-attempt"


def attempt_of(headers: list[tuple[str, bytes | None]] | None) -> str | None:
    for key, value in headers or ():
        if key == ATTEMPT_HEADER and value is not None:
            return value.decode("ascii", "replace")
    return None


@dataclass
class AnswerText:
    """The text to show from one request's chunks, across serving attempts.

    The newest attempt wins; what was already shown is not repeated: the new attempt's text is
    shown from the same character count on (identical for greedy decoding; with sampling the
    answer continues from the retry's text). Chunks of a retired attempt and duplicates are
    ignored.
    """

    attempt: str | None = None
    retired: set = field(default_factory=set)
    next_index: int = 0
    attempt_chars: int = 0
    shown_chars: int = 0

    def feed(self, chunk: Any, attempt: str | None) -> str | None:
        """New text to show ("" for none); None when the chunk is not part of the answer.

        ``chunk`` is a ``TokenChunk`` (``index``, ``text``); ``attempt`` its attempt header.
        """
        if attempt in self.retired:
            return None
        if attempt != self.attempt:
            if self.attempt is not None or self.next_index:
                self.retired.add(self.attempt)
            self.attempt, self.next_index, self.attempt_chars = attempt, 0, 0
        if chunk.index < self.next_index:
            return None
        self.next_index = chunk.index + 1
        self.attempt_chars += len(chunk.text)
        new = self.attempt_chars - self.shown_chars
        if new <= 0:
            return ""
        self.shown_chars += new
        return chunk.text[len(chunk.text) - new:]
