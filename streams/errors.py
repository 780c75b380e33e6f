"""Named errors of the streams tier.

A fault of the record (every error here but ``InfrastructureUnavailableError`` and
``TokenizerNotFoundError``) becomes a dead letter with its message as the reason; the
infrastructure's is retried, then stops the process unacknowledged (``transport/failures.py``,
``streams/faults.py``).
"""

from __future__ import annotations

from schemas.errors import ChatpipeError
from transport.failures import Fault, OutageError


class StreamsError(ChatpipeError):
    """Root of the streams tier's errors: the record's fault unless a class says otherwise."""

    fault = Fault.RECORD  # transport.failures: dead-lettered and acked


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

    fault = Fault.FATAL  # configuration


class InvalidReplyAddressError(StreamsError):
    """A PromptRequest whose ``reply_to`` is not a topic on the broker, or whose ``reply_partition``
    is outside it: nobody can be answered there, so only the dead letter says why."""


class ExpiredRequestError(StreamsError):
    """A PromptRequest taken after its ``deadline_at``: the asker has stopped waiting."""


class DeadlineUnreachableError(StreamsError):
    """A PromptRequest whose ``deadline_at`` the inference fleet cannot meet by its own estimate
    (``transport/fleet.py``): refused at once with the estimate and when to retry, instead of queued
    to expire (the gateway's 429 ``deadline_unreachable``, for a producer without a gateway)."""


class InfrastructureUnavailableError(StreamsError, OutageError):
    """Qdrant, the broker or the archive's disk kept failing for the whole retry budget.

    Not a fault of any record: the batch in hand is not acknowledged and the process exits
    (``streams.faults.EXIT_INFRASTRUCTURE``), so the batch is read again after the restart.
    """

    fault = Fault.TRANSIENT  # not retried again: its budget is spent (OutageError)

