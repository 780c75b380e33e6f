"""The streams tier's failure policy: what is retried, and how the process stops when retries run out.

A fault of **the record** (it does not decode, is invalid, expired, has no usable reply address)
is the agent's to answer: a dead letter, an error chunk where possible, and the record is acked.
A fault of **the infrastructure** (Qdrant, the broker, the archive's disk) is retried here, with
exponential backoff, for a bounded budget (``StreamsSettings.retry_budget_s``). Every retried
effect is idempotent (point ids and turn ids derive from the request id, archive files from the
offsets, a re-sent record carries the same key), so a retry that repeats an effect that had in
fact happened is harmless.

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

import asyncio
import logging
import os
import sqlite3
import sys
import time
from typing import Any, Awaitable, Callable, NoReturn, TypeVar

from aiokafka.errors import KafkaError
from faust.exceptions import ProducerSendError

from streams.errors import InfrastructureUnavailableError
from streams.memory import MemoryRequestError, MemoryUnavailableError
from transport.errors import TransportError

log = logging.getLogger(__name__)
R = TypeVar("R")

#: sysexits' EX_TEMPFAIL: an outage outlasted the retry budget; a restart is the remedy.
EXIT_INFRASTRUCTURE = 75
#: sysexits' EX_SOFTWARE: an unexpected exception (a bug); the batch is not acked either.
EXIT_BUG = 70

#: Faults of the infrastructure, worth a retry. MemoryRequestError (a Qdrant 4xx) is no outage,
#: but not the record's fault either: retried, then the process stops rather than ack.
#: OSError covers disk errors (ENOSPC, EACCES, EROFS), ConnectionError and TimeoutError; sqlite3
#: errors are Qdrant local mode's disk errors.
INFRASTRUCTURE_ERRORS: tuple[type[BaseException], ...] = (
    MemoryUnavailableError, MemoryRequestError, KafkaError, ProducerSendError, TransportError, OSError,
    sqlite3.Error,
)


class Retrier:
    """Runs an infrastructure call until it succeeds or ``budget_s`` has passed since it first failed."""

    def __init__(self, budget_s: float, backoff_s: float, max_backoff_s: float, *,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.budget_s = budget_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._sleep = sleep
        self._clock = clock
        self.retries = 0  # for logs and tests

    async def call(self, what: str, fn: Callable[..., Awaitable[R]], *args: Any, **kwargs: Any) -> R:
        """``await fn(*args, **kwargs)``, retried on ``INFRASTRUCTURE_ERRORS``; other exceptions pass
        through at once. Raises ``InfrastructureUnavailableError`` when the budget is spent."""
        deadline: float | None = None
        delay = self.backoff_s
        while True:
            try:
                return await fn(*args, **kwargs)
            except INFRASTRUCTURE_ERRORS as exc:
                now = self._clock()
                deadline = now + self.budget_s if deadline is None else deadline
                if now >= deadline:
                    raise InfrastructureUnavailableError(
                        f"{what}: still failing after {self.budget_s:g} s of retries: "
                        f"{type(exc).__name__}: {exc}") from exc
                self.retries += 1
                log.warning("%s failed (%s: %s); retrying in %.1f s", what, type(exc).__name__, exc, delay)
                await self._sleep(min(delay, deadline - now))
                delay = min(delay * 2, self.max_backoff_s)


def exit_code_for(exc: BaseException) -> int:
    return EXIT_INFRASTRUCTURE if isinstance(exc, InfrastructureUnavailableError) else EXIT_BUG


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
