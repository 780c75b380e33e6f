"""Named errors of the streams tier; each one becomes a dead letter with its message as the reason."""

from __future__ import annotations

from schemas.errors import ChatpipeError


class StreamsError(ChatpipeError):
    """Root of the streams tier's errors."""


class InvalidPromptError(StreamsError):
    """A PromptRequest that decodes but cannot be served (no user message, empty text, ...)."""


class PromptTooLongError(StreamsError):
    """The system prompt plus the new prompt alone do not fit the model's context budget."""


class UnknownRequestError(StreamsError):
    """A Response whose request intake never saw (or whose conversation was forgotten meanwhile)."""


class InvalidDeletionError(StreamsError):
    """A Deletion that names no conversation although its scope is CONVERSATION."""


class TokenizerNotFoundError(StreamsError):
    """No chat-model tokenizer where the settings point."""
