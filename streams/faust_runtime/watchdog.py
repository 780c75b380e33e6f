"""Records waiting on a source partition that no longer reach its agent: the process exits to be restarted.

Seen on the whole stack (tests/faults, the streams SIGKILL scenario, about one run in six): after
a restart Faust's recovery resumes fetching, hands the agents what it fetched, then seeks the
stream partitions back to the committed offsets; in the failing runs nothing more arrived from
those partitions afterwards. The intake agent sat idle in its batch loop, Faust's fetcher waited
on its consumer thread, 37 prompts waited on ``chat.prompts`` with the group's offsets frozen, for
minutes, until something woke the consumer thread (a debugger attaching was enough). The cause
inside faust-streaming / aiokafka is not found (cf. faust-streaming#216, a gap from resuming
before the seek); the failure policy's answer to a process that no longer consumes is the same as
to a dead thread: exit, so the supervisor restarts it. A restart reads again from the committed
offsets, and no agent acks before its effects are durable (``acks.py``), so nothing is lost.
Before it exits on a stall the process commits what its agents acked (``commit_acked_before_exit``),
as Faust's next periodic commit would have: without that, every record served on the partitions
that still worked since the last commit is served again after the restart (a second
InferenceRequest for a prompt already sent to the engine, seen in tests/streams).

A partition counts as **stalled** when, for ``stall_s`` in a row: it is assigned to this process,
records wait on it (end offset > the group's committed offset), that committed offset has not
moved, no batch of any agent is out (a batch retrying an outage is progress, bounded by its own
retry budget), and no event of that partition reached an agent. Checked every ``check_every_s``
against the broker (``TopicAdmin.backlogs``, in a thread); a check the broker does not answer is
skipped: an outage is the retriers' and the consumer's business, not a stall.

The same answer covers a **restore that stalls**: while Faust restores the conversations table from its
changelog (after a rebalance) no agent runs, by design, so the check above waits; but when a changelog
partition with records still to restore has delivered none for ``stall_s``, the restore is stuck.
Seen on the scale-out stack (CI, 2026-12-06, tests/cluster/test_streams_scale_out.py): a second
worker joined a second after the first prompt; the first worker's restore of
``chatpipe-streams-conversations-changelog[4]`` (one record, offset 0, highwater 0) received nothing for
four minutes ("No event received for active tp ... since recovery start", every 5 s) and the answer
waiting on ``chat.responses[4]`` became a turn only at the next rebalance. A known faust-streaming
hang (faust-streaming#155, robinhood/faust#218), cause upstream not found; a restart restores again.

Tests: tests/streams/test_watchdog.py ``test_waiting_records_that_reach_no_agent_are_a_stall_after_stall_s``,
``test_a_restore_that_receives_nothing_for_stall_s_is_a_stall``,
``test_progress_or_an_idle_partition_is_no_stall``, ``test_an_event_loop_that_stops_turning_ends_the_process_with_its_stacks``,
``test_a_stall_exit_commits_what_was_acked_or_says_what_is_read_again``.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from streams.faust_runtime.acks import Batches
from streams.errors import InfrastructureUnavailableError
from streams.faults import EXIT_INFRASTRUCTURE
from transport.errors import TransportError

log = logging.getLogger(__name__)

TP = tuple[str, int]
#: (topic, partition) list -> {(topic, partition): (committed position, end offset)}
BacklogQuery = Callable[[list[TP]], dict[TP, tuple[int, int]]]


class StalledConsumerError(InfrastructureUnavailableError):
    """Records wait on assigned partitions and nothing reaches the agents: the process must restart."""


@dataclass
class _Seen:
    position: int
    since: float  # when this position was first seen with records waiting and nothing moving
    warned: bool = False


@dataclass(frozen=True)
class RestoreProgress:
    """A table restore in progress, as Faust's recovery counts it (times on ``time.monotonic``)."""

    started_at: float
    remaining: dict[TP, int]  # changelog partition -> records still to restore
    received_at: dict[TP, float]  # changelog partition -> when its last record arrived


def restore_stalls(progress: RestoreProgress | None, now: float, stall_s: float) -> dict[TP, str]:
    """The changelog partitions with records left to restore and none received for ``stall_s``, each
    with what is known of it."""
    if progress is None:
        return {}
    stalled = {}
    for tp, left in sorted(progress.remaining.items()):
        quiet_s = now - progress.received_at.get(tp, progress.started_at)
        if left > 0 and quiet_s >= stall_s:
            stalled[tp] = f"{tp[0]}[{tp[1]}] ({left} record(s) to restore, none received for {quiet_s:.0f} s)"
    return stalled


@dataclass
class ProgressWatchdog:
    backlogs: BacklogQuery
    stall_s: float
    clock: Callable[[], float] = time.monotonic
    batches: Iterable[Batches] = field(default_factory=lambda: Batches.live)
    restore: Callable[[], RestoreProgress | None] = lambda: None  # a table restore in progress, if any
    _seen: dict[TP, _Seen] = field(default_factory=dict)

    def check(self, assigned: list[TP]) -> list[TP]:
        """Look once; returns the partitions stalled for ``stall_s`` (empty: all is well). Blocking: the
        broker is asked (call it from a thread)."""
        try:
            positions = self.backlogs(sorted(assigned))
        except TransportError as exc:
            log.debug("progress check skipped: %s", exc)
            return []
        now = self.clock()
        live = list(self.batches)
        busy = any(b.out for b in live)
        stalled = []
        for tp in list(self._seen):
            if tp not in positions:
                del self._seen[tp]  # revoked, or no longer ours
        for tp, (position, end) in positions.items():
            seen = self._seen.get(tp)
            last_event = max((b.last_event_at.get(tp, float("-inf")) for b in live), default=float("-inf"))
            if end <= position or busy:
                self._seen.pop(tp, None)
                continue
            if seen is None or seen.position != position:
                self._seen[tp] = seen = _Seen(position, now)
            frozen_s = min(now - seen.since, now - last_event)
            if frozen_s >= self.stall_s:
                stalled.append(tp)
            elif frozen_s >= self.stall_s / 2 and not seen.warned:
                seen.warned = True
                log.warning("%s[%d]: %d record(s) wait at offset %d and none reached an agent for %.0f s",
                            tp[0], tp[1], end - position, position, frozen_s)
        return stalled

    def _broker_answers(self, tps: list[TP]) -> bool:
        """Whether the broker answers for ``tps`` (an outage is the consumer's to ride out, not a stall)."""
        try:
            self.backlogs(tps)
        except TransportError as exc:
            log.debug("restore check skipped: %s", exc)
            return False
        return True

    async def run(self, assigned: Callable[[], list[TP]], check_every_s: float) -> None:
        """Check every ``check_every_s``; raises ``StalledConsumerError`` naming what is stalled.

        Also starts a ``LoopHeartbeat``: an event loop that stops turning cannot run this check."""
        log.info("progress watchdog: checks every %g s, a partition with records waiting and none reaching "
                 "an agent for %g s ends the process", check_every_s, self.stall_s)
        heartbeat = LoopHeartbeat(max(self.stall_s, 2 * check_every_s)).start()
        beating = asyncio.ensure_future(heartbeat.beat_forever(min(0.5, heartbeat.limit_s / 4)))
        try:
            while True:
                await asyncio.sleep(check_every_s)
                tps = assigned()
                if not tps:  # nothing assigned, or Faust is rebalancing / restoring the table: no stall
                    self._seen.clear()
                    stuck = restore_stalls(self.restore(), self.clock(), self.stall_s)
                    if stuck and await asyncio.to_thread(self._broker_answers, list(stuck)):
                        # ... unless the restore itself receives nothing while the broker answers
                        raise StalledConsumerError(f"the table restore stalled: {', '.join(stuck.values())}")
                    continue
                stalled = await asyncio.to_thread(self.check, tps)
                if stalled:
                    detail = ", ".join(f"{t}[{p}] at {self._seen[(t, p)].position}" for t, p in stalled)
                    raise StalledConsumerError(
                        f"records wait on {detail} and none reached an agent for {self.stall_s:g} s "
                        "(committed offsets unchanged, no batch in progress): the consumer stalled")
        finally:
            beating.cancel()
            heartbeat.stop()  # the loop is stopping (or this raised): its silence is no stall any more


class LoopHeartbeat:
    """A thread that ends the process when the event loop has not turned for ``limit_s``.

    Everything else here runs on the loop, so a loop blocked in a synchronous call (a hung client
    call, a lock taken on the loop's thread) would stall every agent and this watchdog with them.
    The thread dumps every thread's stack to stderr (the service log) first, so the cause can be
    found, then exits 75 like ``faults.exit_without_ack``: nothing acked, read again after the restart.
    """

    def __init__(self, limit_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit_s = limit_s
        self._clock = clock
        self._last = clock()
        self._stop = threading.Event()

    async def beat_forever(self, every_s: float = 0.5) -> None:
        """On the loop: beats as long as the loop turns."""
        while True:
            self._last = self._clock()
            await asyncio.sleep(every_s)

    def silent_for(self) -> float:
        return self._clock() - self._last

    def start(self) -> "LoopHeartbeat":
        threading.Thread(target=self._watch, name="chatpipe-loop-heartbeat", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.limit_s / 4)):
            if self.silent_for() > self.limit_s:
                log.critical("the event loop has not turned for %.0f s: every agent is stalled; dumping the "
                             "threads' stacks and exiting with code 75", self.silent_for())
                for handler in logging.getLogger().handlers:
                    handler.flush()
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(EXIT_INFRASTRUCTURE)


async def commit_acked_before_exit(app, timeout_s: float = 10.0) -> bool:
    """Commit the offsets the agents acked, before a stall exit; True when that commit went through.

    Safe by construction: an agent acks only once a batch's effects are durable (``acks.py``), and
    Faust's commit flushes the producer (the table's changelog) before committing, exactly as its
    periodic commit does. The stalled partitions' offsets have not moved (that is the stall), so their
    records are read again after the restart. The loop still turns (the heartbeat would have ended
    the process otherwise) and no batch is out (a stall requires it), so the acks are final. Bounded
    by ``timeout_s``: a commit that hangs or fails is given up, and the records acked since the last
    commit are read again (at-least-once; readers dedupe by request_id, docs/worker.md)."""
    try:
        await asyncio.wait_for(app.consumer.commit(), timeout_s)
    except Exception as exc:  # noqa: BLE001 - the process is exiting either way; say what is read again
        log.warning("stall exit: could not commit the acknowledged offsets within %g s (%s: %s); records "
                    "acked since the last commit are read again after the restart", timeout_s,
                    type(exc).__name__, exc)
        return False
    log.info("stall exit: committed the acknowledged offsets; the stalled partitions are read again "
             "from their committed offsets after the restart")
    return True


def faust_assignment(app, source_topics: set[str]) -> Callable[[], list[TP]]:
    """The source partitions a Faust app consumes now; none while it rebalances or restores its tables
    (records wait then by design, for as long as a restore takes)."""
    def assigned() -> list[TP]:
        if getattr(app, "rebalancing", False) or getattr(app, "in_recovery", False):
            return []
        try:
            tps = app.consumer.assignment()
        except Exception:  # noqa: BLE001 - not started yet (ConsumerNotStarted and friends)
            return []
        return [(tp.topic, tp.partition) for tp in tps if tp.topic in source_topics]

    return assigned


def faust_restore(app) -> Callable[[], RestoreProgress | None]:
    """The restore Faust's recovery (``app.tables.recovery``) has in progress, read from its own counters
    (faust-streaming 0.15.3: ``in_recovery``, ``_recovery_started_at``, ``active_remaining()``,
    ``_active_events_received_at``, all on ``time.monotonic``); None when none is."""
    def progress() -> RestoreProgress | None:
        try:
            recovery = app.tables.recovery
            started = recovery._recovery_started_at
            if not recovery.in_recovery or started is None:
                return None
            return RestoreProgress(started, {(tp.topic, tp.partition): n for tp, n in recovery.active_remaining().items()},
                                   {(tp.topic, tp.partition): t for tp, t in recovery._active_events_received_at.items()})
        except AttributeError:  # not started yet, or a Faust without these counters: no restore check
            return None

    return progress
