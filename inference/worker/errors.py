"""Named errors of the inference worker. A request that raises one of the ``BadRequestError``s is
answered with an error Response and dead-lettered with the error's message as the reason."""

from __future__ import annotations

from schemas.errors import ChatpipeError


class WorkerError(ChatpipeError):
    """Root of the worker's own errors."""


class BadRequestError(WorkerError):
    """The request can never be served as it is; retrying it will not help."""


class InvalidRequestError(BadRequestError):
    """No messages, an unknown role, an empty prompt."""


class InvalidSamplingError(BadRequestError):
    """Sampling parameters out of range (max_tokens < 1, temperature < 0, top_p outside (0, 1], ...)."""


class PromptTooLongError(BadRequestError):
    """Prompt tokens + max_tokens exceed the model's context (or the whole KV cache)."""


class TooManyDeliveriesError(WorkerError):
    """share intake: the record was delivered more often than allowed (it keeps failing somewhere)."""
