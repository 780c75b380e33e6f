"""The streams tier's side of the failure policy: its retrier, and how the process stops.

What is whose fault, and the retry loop itself, are ``transport.failures`` (one policy, every
tier). A fault of **the record** is the agent's to answer: a dead letter, an error chunk where
possible, and the record is acked. A fault of **the infrastructure** (Qdrant, the broker, the
archive's disk) is retried by ``Retrier`` with exponential backoff for one bounded budget
(``StreamsSettings.retry_budget_s``; the memory makes one attempt per call inside it, rotating
to the next Qdrant peer). Every retried effect is idempotent (point ids and turn ids derive from
the request id, archive files from the offsets, a re-sent record carries the same key), so a
retry that repeats an effect that had in fact happened is harmless.

Past the budget the call raises ``InfrastructureUnavailableError``; the agent does not ack its
batch, and ``exit_without_ack`` ends the process at once (``os._exit``): no Faust shutdown, so
no offset commit, so the unacked batch is read again after the supervisor's restart. A graceful
stop would also keep unacked offsets, but it can hang on the very thing that failed (a memory
call in flight, a producer flush to an absent broker); a hard exit is what a SIGKILL does, and
every agent is already safe against that.

Anything else escaping an agent (a bug) exits the same way with another code: retrying a bug
does not help, and acking the batch it failed on would lose it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

from streams.errors import InfrastructureUnavailableError
from transport import failures
from transport.failures import OutageError

log = logging.getLogger(__name__)

#: sysexits' EX_TEMPFAIL: an outage outlasted the retry budget; a restart is the remedy.
EXIT_INFRASTRUCTURE = 75
#: sysexits' EX_SOFTWARE: an unexpected exception (a bug); the batch is not acked either.
EXIT_BUG = 70


class Retrier(failures.Retrier):
    """``transport.failures.Retrier`` whose spent budget raises ``InfrastructureUnavailableError``."""

    error = InfrastructureUnavailableError


def exit_code_for(exc: BaseException) -> int:
    return EXIT_INFRASTRUCTURE if isinstance(exc, OutageError) else EXIT_BUG


def exit_without_ack(component: str, exc: BaseException) -> NoReturn:
    """End the process now, committing nothing: the batch ``component`` failed on is read again."""
    code = exit_code_for(exc)
    log.critical("%s stopped: %s: %s. Exiting with code %d without acknowledging its batch; it is read "
                 "again after the restart", component, type(exc).__name__, exc, code, exc_info=exc)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
