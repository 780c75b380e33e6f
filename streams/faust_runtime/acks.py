"""Batches of Faust events that are acked only when the agent says so.

Faust's ``take_events`` acks every event of a batch in a ``finally``, and ``events()`` each
event, even when the agent body raised; Faust's supervisor then restarts the agent on the next
batch, and the failed batch's offsets get committed. ``noack_take`` buffers the same way but
never acks: the agent acks (``Batches.ack``) once the batch's effects are durable.

Faust commits, per partition, the first run of consecutive acked offsets
(``Consumer._new_offset``), and does **not** hold that run back for an unacked event at exactly
the committed position (it only checks ``min(acked) - committed > 1``; with nothing committed
yet it does not check at all; tests/streams/test_failure_policy.py pins this). So an unacked event only
stays uncommitted if nothing after it on its partition is acked. The agents keep that true:
one agent per source topic, concurrency 1, batches handled one after another and acked in
arrival (= offset) order, and after a batch fails nothing else is acked: the process exits
(``streams/faults.py``).

Faust may also deliver an event a second time within one process: at start-up its recovery
resumes the fetcher while restoring the table and then seeks the stream partitions back to the
committed offsets, so events fetched in between come again (seen in tests/streams/
test_no_ack_on_failure.py: the same prompts served twice, 0.1 s apart). ``Batches`` remembers,
per partition, the highest offset this process handled and acked, and acks such a repeat
without handing it to the agent again. Its effects were durable before that ack, so skipping
it is exact; a new process starts with nothing remembered and handles what it is given. Both
copies can also arrive in **one** batch (the seek back came before the first copy was handed
out: seen once the seek covered partitions nobody had committed, three prompts served twice and
a deletion fanned out twice); the batch then holds the first copy only, and the later ones are
acked right after it.

It also guards against a **gap**: an event past the next offset this process expects on its
partition (the offset after the last it was handed, or for the first where the group reads from:
Faust's committed position, or, before Faust knows it, the broker's, or with nothing committed the
partition's first offset, since the group reads from the earliest).
The source topics have no compaction and no transaction markers, so within one process their
offsets are consecutive. Faust's recovery resumes fetching before it seeks back to the committed
offsets (faust-streaming#216), so an event past a gap usually means the seek is about to deliver
the missing ones again; but Faust can also drop them for good (seen: one turn never archived after a
streams SIGKILL, tests/faults; and aiokafka's seek skipped a partition nobody had committed, which
``offsets.py`` now seeks to its beginning), and acking past a gap lets Faust commit over the
missing event (it does not hold a commit back for an unacked event at exactly the committed
position). So events past a gap are **withheld**: not handed to the agent, not acked, until the
missing offsets come (then the withheld copies are acked once their offsets are handled). If they
do not come within ``GAP_GRACE_S``, ``DeliveryGapError`` (an infrastructure fault) ends the process
unacked, and the restart reads from the committed offsets; if nothing more arrives at all, the
progress watchdog (``watchdog.py``) does the same.

Every ``Batches`` of the process is listed in ``Batches.live`` with when it last saw an event of each
partition and whether a batch is out (yielded, not yet acked): what ``watchdog.py`` reads to tell an
idle agent from one its records no longer reach.

Upstream (faust-streaming 0.15.3): ``Consumer._new_offset`` commits over an unacked event at exactly
the committed position; the recovery resumes fetching before its seek back (faust-streaming#216).
Tests: tests/streams/test_failure_policy.py ``test_faust_commits_past_an_unacked_event_at_the_committed_position``
(pins the upstream rule), ``test_events_faust_delivers_again_in_the_same_process_are_acked_not_handled_again``,
``test_both_copies_of_an_event_in_one_batch_are_handled_once_and_the_copy_acked_after_it``;
tests/streams/test_delivery_gaps.py (the gap guard).
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, AsyncIterator, ClassVar, Sequence

from streams.errors import InfrastructureUnavailableError
from streams.faust_runtime.offsets import committed_position, group_committed
from streams.faust_runtime.take import take_while_arriving

log = logging.getLogger(__name__)


#: How long events past a gap are held for the missing ones to come (Faust's own seek back after
#: its recovery delivers them again within a second); past it the process exits unacked.
GAP_GRACE_S = 10.0


class DeliveryGapError(InfrastructureUnavailableError):
    """Faust handed out an event past one it never delivered: acking it could commit over the missing one."""


def first_copies(events: Sequence[Any]) -> tuple[list, list]:
    """``events`` split into the first copy of each (partition, offset) and the copies that follow it."""
    seen: set = set()
    first, copies = [], []
    for event in events:
        key = (event.message.tp, event.message.offset)
        (copies if key in seen else first).append(event)
        seen.add(key)
    return first, copies


class Batches:
    """An agent's batches: up to ``max_events`` events or what came within ``within_s``, none acked
    until ``ack``; events this process already handled are acked and left out.

    With ``idle_s`` (intake) a batch closes as soon as no further event came within ``idle_s``, and
    ``within_s`` only bounds how long it stays open while events keep coming (``take.py``); without
    it, Faust's ``noack_take`` (its timer closes a batch every ``within_s``)."""

    live: ClassVar[weakref.WeakSet] = weakref.WeakSet()  # every Batches of this process (watchdog.py)

    def __init__(self, stream: Any, max_events: int, within_s: float, idle_s: float | None = None) -> None:
        self.stream = stream
        self.max_events = max_events
        self.within_s = within_s
        self.idle_s = idle_s
        self._handled: dict[Any, int] = {}  # TP -> highest offset handled and acked by this process
        self.repeats = 0
        self.last_event_at: dict[tuple[str, int], float] = {}  # (topic, partition) -> monotonic time
        self._next: dict[Any, int] = {}  # TP -> the offset expected next (one past the last handed out)
        self._gap_since: dict[Any, float] = {}  # TP -> when offsets past a gap began to be withheld
        # TP -> events past a gap, and second copies of an event in its batch: never handed out, acked
        # as copies once their offset is handled (the batch's ack drains the second copies)
        self._withheld: dict[Any, list] = {}
        self.out = False  # a batch was yielded and is not acked yet
        Batches.live.add(self)

    async def __aiter__(self) -> AsyncIterator[Sequence[Any]]:
        taken = (self.stream.noack_take(self.max_events, self.within_s) if self.idle_s is None
                 else take_while_arriving(self.stream, self.max_events, self.within_s, self.idle_s))
        async for events in taken:
            now = time.monotonic()
            handed = []
            for event in events:
                tp = event.message.tp  # Faust's TP, a (topic, partition) named tuple
                self.last_event_at[(tp[0], tp[1])] = now
                if await self._past_a_gap(tp, event.message.offset, now):
                    self._withheld.setdefault(tp, []).append(event)
                else:
                    handed.append(event)
            self._check_gaps_closing(now)
            handed, copies = first_copies(handed)
            fresh = [e for e in handed if e.message.offset > self._handled.get(e.message.tp, -1)]
            handled_copies = [e for e in copies if e.message.offset <= self._handled.get(e.message.tp, -1)]
            for event in copies:  # of a fresh event: held like copies past a gap, acked once it is (ack)
                if event.message.offset > self._handled.get(event.message.tp, -1):
                    self._withheld.setdefault(event.message.tp, []).append(event)
            if len(fresh) < len(handed) or handled_copies:
                repeats = [e for e in handed if e not in fresh] + handled_copies
                for event in repeats:  # at or below acked offsets: acking keeps the acked offsets a prefix
                    await self.stream.ack(event)
                self.repeats += len(repeats)
                log.info("%d event(s) delivered again that this process had handled already; not handled again",
                         len(repeats))
            if fresh:
                self.out = True
                if log.isEnabledFor(logging.DEBUG):
                    self._log_age(fresh)
                yield fresh

    @staticmethod
    def _log_age(events: Sequence[Any]) -> None:
        """How long the batch's oldest record took from its producer to the agent (Kafka hop, fetch, take)."""
        stamps = [t for e in events if isinstance(t := getattr(e.message, "timestamp", None), (int, float))]
        if stamps:
            log.debug("batch of %d from %s handed out %.1f ms after its oldest record was produced", len(events),
                      events[0].message.tp[0], (time.time() - min(stamps)) * 1e3)

    async def _past_a_gap(self, tp: Any, offset: int, now: float) -> bool:
        """Whether ``offset`` lies past offsets of ``tp`` never handed out (it is withheld then)."""
        expected = self._next.get(tp)
        if tp not in self._gap_since:
            # Another member may have moved the partition on while it was not ours: the committed
            # position is then ahead of what this process last saw, and reading resumes there.
            known = [p for p in (expected, committed_position(self._consumer(), tp)) if p is not None]
            if not known:  # Faust does not know yet where the group stands: the broker is asked
                start = await self._group_start(tp)
                known = [start] if start is not None else []
            if known and offset > max(known) and not await self._retention_removed(tp, max(known), offset):
                self._gap_since[tp] = now
                self._next[tp] = max(known)
                log.warning("%s[%d]: offset %d handed out before %d; holding it until %d..%d come (Faust's "
                            "seek back), at most %g s", tp[0], tp[1], offset, max(known), max(known), offset - 1,
                            GAP_GRACE_S)
                return True
            self._next[tp] = max(offset + 1, expected or 0)
            return False
        if offset > expected:
            return True
        self._next[tp] = max(offset + 1, expected)
        if self._next[tp] > min((e.message.offset for e in self._withheld.get(tp, ())), default=-1):
            del self._gap_since[tp]  # the missing offsets came: what was held is a copy of what follows
            log.info("%s[%d]: the missing offsets came; going on", tp[0], tp[1])
        return False

    def _check_gaps_closing(self, now: float) -> None:
        for tp, since in self._gap_since.items():
            if now - since > GAP_GRACE_S:
                held = sorted(e.message.offset for e in self._withheld.get(tp, ()))
                raise DeliveryGapError(f"{tp[0]}[{tp[1]}]: offsets from {self._next[tp]} never delivered in "
                                       f"{GAP_GRACE_S:g} s while {len(held)} later one(s) came (first {held[0]})")

    async def _retention_removed(self, tp: Any, missing_from: int, offset: int) -> bool:
        """Whether the missing offsets are gone from the log (retention), not dropped on the way."""
        first = await self._log_start(tp)  # None: cannot tell, treated as a gap (the restart asks again)
        return first is not None and offset <= first

    async def _group_start(self, tp: Any) -> int | None:
        """Where the group reads ``tp`` from: its committed offset on the broker, or with none the log's
        first offset (``auto_offset_reset`` earliest); None when the broker cannot be asked (no check)."""
        consumer = self._consumer()
        if consumer is None:
            return None
        try:
            committed = await group_committed(consumer, tp)
        except Exception as exc:  # noqa: BLE001 - the broker away, or a test double: no gap check for it
            log.debug("%s[%d]: the group's committed offset is not known (%s)", tp[0], tp[1], exc)
            return None
        return committed if committed is not None and committed >= 0 else await self._log_start(tp)

    async def _log_start(self, tp: Any) -> int | None:
        """The first offset ``tp``'s log still holds (None when the broker cannot be asked)."""
        try:
            return (await self._consumer().earliest_offsets(tp)).get(tp)
        except Exception:  # noqa: BLE001 - a test double without a consumer, or the broker away
            return None

    def _consumer(self) -> Any:
        """Faust's consumer of the stream's app (None: a test double without one)."""
        return getattr(getattr(self.stream, "app", None), "consumer", None)

    async def ack(self, events: Sequence[Any]) -> None:
        """Ack ``events`` in order once their effects are durable: their offsets become committable."""
        for event in events:
            await self.stream.ack(event)
            tp, offset = event.message.tp, event.message.offset
            self._handled[tp] = max(offset, self._handled.get(tp, -1))
        for tp, held in list(self._withheld.items()):  # copies of offsets now handled: Faust tracks them
            done = [e for e in held if e.message.offset <= self._handled.get(tp, -1)]
            for event in done:
                await self.stream.ack(event)
            self._withheld[tp] = [e for e in held if e not in done]
            if not self._withheld[tp]:
                del self._withheld[tp]
        self.out = False

