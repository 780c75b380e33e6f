"""The failure policy, as code: which exception is whose fault, and the one retry budget.

docs/architecture.md "Failure policy" says what each tier does; this module decides, for every
tier (gateway, inference worker, streams, memory, the consumers of ``transport``), which of the
three kinds a fault is. ``classify(exc)`` is the only place that decision is made:

``Fault.RECORD`` — the record's fault. Retrying the same record cannot succeed; the tier answers it
(a dead letter, an error chunk / Response / HTTP 4xx) and commits it, so one bad record never
stops a tier.

- ``schemas.errors.DecodeError`` (bytes that are not a record of this build, a tombstone);
- an error whose class says so with ``fault = Fault.RECORD``: the worker's ``BadRequestError``
  family (invalid, too long, expired, an unusable reply address, too many deliveries) and the
  streams tier's ``StreamsError`` family (invalid prompt or deletion, too long, expired, an
  unusable reply address, an unknown request) but ``TokenizerNotFoundError`` (FATAL: configuration)
  and ``InfrastructureUnavailableError`` (an ``OutageError``);
- Kafka codes about the record itself: ``MSG_SIZE_TOO_LARGE``, ``RECORD_LIST_TOO_LARGE``,
  ``INVALID_MSG_SIZE``, ``INVALID_RECORD``, ``INVALID_MSG`` (``RECORD_CODES``);
- with ``address_from_record=True`` (a send to an address the record named: ``reply_to`` /
  ``reply_partition``), Kafka codes about that address: ``_UNKNOWN_PARTITION``, ``_UNKNOWN_TOPIC``,
  ``UNKNOWN_TOPIC_OR_PART``, ``TOPIC_EXCEPTION`` (an invalid name), ``TOPIC_AUTHORIZATION_FAILED``
  (``ADDRESS_CODES``). For a topic of our own the same codes are not the record's: an unknown
  topic or partition is a topic being recreated or a leader moving (TRANSIENT), a bad name or a
  refused authorisation is configuration (FATAL).

``Fault.TRANSIENT`` — the infrastructure's. Retried with backoff within one budget (``Retrier``),
idempotently (effects are keyed by request id / turn id / archive offset); past the budget the
process exits non-zero **without acking**, so the input is read again after the restart.

- Kafka codes of a broker away, a leader or topic moving, the group moving, share sessions,
  quotas, a delivery timed out (``TRANSIENT_CODES``; ``KafkaError.retriable()`` says False for
  nearly all of them, e.g. ``UNKNOWN_TOPIC_OR_PART`` while a topic is recreated, so it cannot
  decide);
- ``transport.errors.TransportError`` carrying no Kafka code (nor a cause with one): a broker not
  reachable, a delivery that did not happen, a consumer's transient errors past its budget;
- ``OSError``: disk full (``ENOSPC``, ``EDQUOT``), unwritable (``EACCES``, ``EROFS``), ``EIO``, and
  ``ConnectionError`` / ``TimeoutError``: a disk or a peer someone is fixing;
- ``sqlite3.OperationalError``: Qdrant local mode's disk (locked, full, I/O error);
- Qdrant and its HTTP client, recognised by type name so that ``transport`` (which every tier
  installs) does not import them: ``httpx.TransportError`` (connect, read, timeouts),
  qdrant-client's ``ResponseHandlingException`` and ``UnexpectedResponse`` with HTTP 5xx, 429 or
  no status (a peer dying, overloaded);
- aiokafka's ``KafkaError`` and faust's ``ProducerSendError`` (the streams tier's Faust producer);
- an error whose class says ``fault = Fault.TRANSIENT`` (memory's ``MemoryUnavailableError``, and
  ``MemoryRequestError``: a Qdrant 4xx is no outage, but not the record's fault either, so it is
  retried and then stops the process rather than ack);
- ``OutageError``: a budget already spent. It is TRANSIENT (the exit code says "restart me"), but
  a ``Retrier`` never retries it: one budget, never one budget inside another.

``Fault.FATAL`` — a bug or a configuration error. Retrying cannot help and acking would lose
the record: the process exits at once, unacked (streams 70, the worker 1, 78 at start for
credentials, ``transport.connect_check``).

- a Kafka error with ``fatal()`` set (an idempotent producer fenced), authentication and
  authorisation (``_AUTHENTICATION``, ``SASL_AUTHENTICATION_FAILED``, ``_SSL``,
  ``GROUP_AUTHORIZATION_FAILED``), configuration (``INVALID_GROUP_ID``,
  ``INCONSISTENT_GROUP_PROTOCOL``, ``UNSUPPORTED_VERSION``, ``_INVALID_ARG``), a lost position
  (``OFFSET_OUT_OF_RANGE``), every Kafka code not named above;
- ``EncodeError`` and ``SchemaError`` (a record we built does not fit its schema), Qdrant 4xx
  outside the memory, every other exception.

``Retrier`` is the one retry loop: deadline-based (``budget_s`` from the first failure), backoff
from ``backoff_s`` doubling up to ``max_backoff_s``; only TRANSIENT faults are retried, anything
else passes through at once; when the budget is spent it raises ``Retrier.error`` (an
``OutageError``) from the last fault. ``call`` awaits, ``call_blocking`` sleeps the thread.
``ErrorBudget`` is the same budget for a poll loop, where librdkafka reports consumer errors as
events instead of raising: a streak of TRANSIENT errors longer than ``budget_s`` raises
``TransportError`` (the group, share and tail consumers).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import sqlite3
import time
from typing import Any, Awaitable, Callable, TypeVar

from confluent_kafka import KafkaError, KafkaException

from schemas.errors import ChatpipeError, DecodeError, EncodeError, SchemaError
from transport.errors import DeliveryError, TransportError

log = logging.getLogger(__name__)
R = TypeVar("R")


class Fault(enum.Enum):
    RECORD = "record"  # answer it (dead letter / error chunk) and commit
    TRANSIENT = "transient"  # retry within the budget, then exit unacked
    FATAL = "fatal"  # a bug or a configuration error: exit unacked


class OutageError(ChatpipeError):
    """The infrastructure stayed away for a whole retry budget: exit unacked, restart."""

    fault = Fault.TRANSIENT


E = KafkaError
TRANSIENT_CODES = frozenset({
    # broker unreachable, a delivery that timed out
    E._TRANSPORT, E._ALL_BROKERS_DOWN, E._RESOLVE, E._TIMED_OUT, E._TIMED_OUT_QUEUE, E.REQUEST_TIMED_OUT,
    E.NETWORK_EXCEPTION, E.BROKER_NOT_AVAILABLE, E._MSG_TIMED_OUT, E._QUEUE_FULL, E._WAIT_COORD,
    E.NOT_ENOUGH_REPLICAS, E.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
    # a topic recreated, a leader moving
    E.UNKNOWN_TOPIC_OR_PART, E._UNKNOWN_TOPIC, E._UNKNOWN_PARTITION, E.UNKNOWN_TOPIC_ID, E.INCONSISTENT_TOPIC_ID,
    E.LEADER_NOT_AVAILABLE, E.NOT_LEADER_FOR_PARTITION, E.FENCED_LEADER_EPOCH, E.UNKNOWN_LEADER_EPOCH,
    E.REPLICA_NOT_AVAILABLE, E.OFFSET_NOT_AVAILABLE, E.KAFKA_STORAGE_ERROR,
    # the group moving (librdkafka rejoins by itself)
    E.NOT_COORDINATOR, E.COORDINATOR_NOT_AVAILABLE, E.COORDINATOR_LOAD_IN_PROGRESS, E.REBALANCE_IN_PROGRESS,
    E.UNKNOWN_MEMBER_ID, E.ILLEGAL_GENERATION, E.FENCED_MEMBER_EPOCH, E.STALE_MEMBER_EPOCH, E._ASSIGNMENT_LOST,
    E._MAX_POLL_EXCEEDED,
    # share sessions, quotas
    E.SHARE_SESSION_NOT_FOUND, E.INVALID_SHARE_SESSION_EPOCH, E.SHARE_SESSION_LIMIT_REACHED,
    E.FETCH_SESSION_ID_NOT_FOUND, E.INVALID_FETCH_SESSION_EPOCH, E.THROTTLING_QUOTA_EXCEEDED,
})
#: The record itself is refused by the broker, whatever the topic.
RECORD_CODES = frozenset({E.MSG_SIZE_TOO_LARGE, E.RECORD_LIST_TOO_LARGE, E.INVALID_MSG_SIZE, E.INVALID_RECORD,
                          E.INVALID_MSG})
#: The topic or partition written to: the record's fault where the record named it (a reply address).
ADDRESS_CODES = frozenset({E._UNKNOWN_PARTITION, E._UNKNOWN_TOPIC, E.UNKNOWN_TOPIC_OR_PART, E.TOPIC_EXCEPTION,
                           E.TOPIC_AUTHORIZATION_FAILED})
del E

# Classes of optional dependencies, by "module.QualName" anywhere in the exception's MRO.
_TRANSIENT_TYPES = frozenset({
    "httpx.TransportError",
    "qdrant_client.http.exceptions.ResponseHandlingException",
    "aiokafka.errors.KafkaError",
    "faust.exceptions.ProducerSendError",
})
_QDRANT_RESPONSE = "qdrant_client.http.exceptions.UnexpectedResponse"


def kafka_error(exc: BaseException | KafkaError) -> KafkaError | None:
    """The ``KafkaError`` behind ``exc``: itself, a ``KafkaException``'s, or a cause's."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, KafkaError):
            return exc
        if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
            return exc.args[0]
        if isinstance(exc, DeliveryError) and exc.code is not None:
            return KafkaError(exc.code)
        exc, seen = exc.__cause__, seen + 1
    return None


def _classify_kafka(err: KafkaError, address_from_record: bool) -> Fault:
    code = err.code()
    if err.fatal():
        return Fault.FATAL
    if code in RECORD_CODES or (address_from_record and code in ADDRESS_CODES):
        return Fault.RECORD
    if code in TRANSIENT_CODES:
        return Fault.TRANSIENT
    return Fault.FATAL


def classify(exc: BaseException | KafkaError, *, address_from_record: bool = False) -> Fault:
    """Whose fault ``exc`` is (the table in the module docstring). ``exc`` may also be a consumer's
    ``KafkaError`` event. ``address_from_record``: the failed call wrote to an address the record
    named (a reply address), so errors about that address are the record's."""
    if isinstance(exc, KafkaError):
        return _classify_kafka(exc, address_from_record)
    declared = getattr(exc, "fault", None)
    if isinstance(declared, Fault):
        return declared
    if isinstance(exc, DecodeError):
        return Fault.RECORD
    if isinstance(exc, (EncodeError, SchemaError)):
        return Fault.FATAL
    if isinstance(exc, (KafkaException, TransportError)):
        err = kafka_error(exc)
        if err is not None:
            return _classify_kafka(err, address_from_record)
        return Fault.TRANSIENT if isinstance(exc, TransportError) else Fault.FATAL
    if isinstance(exc, (OSError, sqlite3.OperationalError)):
        return Fault.TRANSIENT
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__}
    if names & _TRANSIENT_TYPES:
        return Fault.TRANSIENT
    if _QDRANT_RESPONSE in names:
        status = getattr(exc, "status_code", None)
        return Fault.TRANSIENT if status is None or status >= 500 or status == 429 else Fault.FATAL
    return Fault.FATAL


class Retrier:
    """Runs a call until it succeeds, a non-TRANSIENT fault passes through, or ``budget_s`` has
    passed since it first failed (then ``error``, an ``OutageError``, is raised from the last
    fault). Backoff: ``backoff_s``, doubling, at most ``max_backoff_s``; the last wait ends at the
    deadline. ``retries`` counts the retries of every call (logs, metrics, tests)."""

    error: type[Exception] = OutageError  # what a spent budget raises

    def __init__(self, budget_s: float, backoff_s: float = 0.5, max_backoff_s: float = 5.0, *,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                 blocking_sleep: Callable[[float], Any] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.budget_s = budget_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._sleep = sleep
        self._blocking_sleep = blocking_sleep
        self._clock = clock
        self.retries = 0

    async def call(self, what: str, fn: Callable[..., Awaitable[R]], *args: Any, **kwargs: Any) -> R:
        """``await fn(*args, **kwargs)`` within the budget."""
        state: list[float] = []
        while True:
            try:
                return await fn(*args, **kwargs)
            except Exception as exc:
                delay = self._after(what, exc, state)
                if delay is None:
                    raise
            await self._sleep(delay)

    def call_blocking(self, what: str, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """``fn(*args, **kwargs)`` within the budget, sleeping this thread between attempts."""
        state: list[float] = []
        while True:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                delay = self._after(what, exc, state)
                if delay is None:
                    raise
            self._blocking_sleep(delay)

    def _after(self, what: str, exc: Exception, state: list[float]) -> float | None:
        """How long to wait before the next attempt; None: re-raise ``exc`` as it is. ``state``:
        [deadline, next delay] of this call, empty before its first failure."""
        if isinstance(exc, OutageError) or classify(exc) is not Fault.TRANSIENT:
            return None
        now = self._clock()
        if not state:
            state[:] = [now + self.budget_s, self.backoff_s]
        deadline, delay = state
        if now >= deadline:
            raise self.error(f"{what}: still failing after {self.budget_s:g} s of retries: "
                             f"{type(exc).__name__}: {exc}") from exc
        self.retries += 1
        log.warning("%s failed (%s: %s); retrying in %.1f s", what, type(exc).__name__, exc, delay)
        state[1] = min(delay * 2, self.max_backoff_s)
        return min(delay, deadline - now)


class ErrorBudget:
    """How long transient consumer errors may go on before they count as the infrastructure away: the
    Retrier's budget for errors a poll loop reports as events (librdkafka hands consumer errors out
    as messages, nothing raises), shared by the group, share and tail consumers.

    A streak is a run of transient errors each less than ``quiet_s`` after the previous one, with
    no message in between (``ok``). librdkafka retries reconnects every ``reconnect.backoff.max.ms``
    (10 s) at most, so an outage keeps the streak going; errors minutes apart are separate blips.
    """

    def __init__(self, budget_s: float = 60.0, quiet_s: float = 15.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget_s = budget_s
        self.quiet_s = quiet_s
        self._clock = clock
        self._since: float | None = None  # first error of the current streak
        self._last = 0.0

    def ok(self) -> None:
        """A message came: whatever went wrong has recovered."""
        self._since = None

    def transient(self, where: str, err: KafkaError) -> None:
        """Log a transient error; ``TransportError`` once the streak is longer than the budget."""
        now = self._clock()
        if self._since is None or now - self._last > self.quiet_s:
            self._since = now
        self._last = now
        if now - self._since > self.budget_s:
            raise TransportError(f"{where}: {err.name()} ({err.str()}) for {now - self._since:.0f} s, past the "
                                 f"retry budget of {self.budget_s:.0f} s")
        log.warning("%s: transient consumer error %s (%s); polling on", where, err.name(), err.str())

    def check(self, where: str, err: KafkaError) -> None:
        """Pass a transient ``err`` (within the budget); raise ``TransportError`` for any other."""
        if classify(err) is Fault.TRANSIENT:
            self.transient(where, err)
        else:
            raise TransportError(f"{where}: {err.name()} ({err.str()})") from KafkaException(err)
