"""Named errors of the inference worker.

Two families, one per side of the failure policy (docs/architecture.md, docs/worker.md):

- ``BadRequestError``: the fault of **the record**. The request is answered, never retried: a
  dead letter with the error's message as the reason, an error final chunk where the reply
  address works, an error Response, and the input is committed / REJECTed. Each subclass names
  the ``error_code`` of that chunk and the Response's ``finish_reason``.
- ``WorkerFailed``: the fault of **the worker or its infrastructure** (a thread that died, the
  engine, the broker past the retry budget). The worker hands its requests back uncommitted and
  exits non-zero, for a supervisor to restart it.
"""

from __future__ import annotations

from schemas.errors import ChatpipeError
from schemas.records import FinishReason
from transport.failures import Fault


class WorkerError(ChatpipeError):
    """Root of the worker's own errors."""


class BadRequestError(WorkerError):
    """The request can never be served as it is; retrying it will not help."""

    fault = Fault.RECORD  # transport.failures: answered and committed

    error_code = "invalid_request"  # TokenChunk.error_code of the error final chunk
    finish_reason = FinishReason.ERROR


class InvalidRequestError(BadRequestError):
    """No messages, an unknown role, an empty prompt."""


class InvalidSamplingError(BadRequestError):
    """Sampling parameters out of range (max_tokens < 1, temperature < 0, top_p outside (0, 1], ...)."""


class PromptTooLongError(BadRequestError):
    """Prompt tokens + max_tokens exceed the model's context (or the whole KV cache)."""

    error_code = "context_length_exceeded"


class ReplyAddressError(BadRequestError):
    """``reply_to`` / ``reply_partition`` name no place the worker can write to (no such topic, a
    partition outside it, an invalid name, a chunk the broker refuses). No chunk can reach the
    asker: the dead letter and the Response carry the reason."""

    error_code = "invalid_reply_address"


class RequestExpiredError(BadRequestError):
    """The request's ``deadline_at`` passed before it could start: its asker has stopped waiting."""

    error_code = "expired"
    finish_reason = FinishReason.TIMEOUT


class TooManyDeliveriesError(BadRequestError):
    """share intake: the record was delivered more often than allowed (it keeps failing somewhere)."""

    error_code = "too_many_deliveries"


class PoisonRecordError(BadRequestError):
    """partition intake: serving the record made the worker crash (an exception that is a bug, not
    the record's known fault) ``max_record_crashes`` times; it is dead-lettered with the last
    crash's reason instead of crashing the worker again (``crash_counts.py``)."""

    error_code = "poison_record"


class WorkerFailed(WorkerError):
    """A part of the worker that it cannot serve without (an intake or cancel thread, the engine)
    has died: the worker stops, hands its requests back and exits non-zero."""
