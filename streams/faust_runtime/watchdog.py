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

Tests: tests/streams/test_watchdog.py ``test_waiting_records_that_reach_no_agent_are_a_stall_after_stall_s``,
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


@dataclass
class ProgressWatchdog:
    backlogs: BacklogQuery
    stall_s: float
    clock: Callable[[], float] = time.monotonic
    batches: Iterable[Batches] = field(default_factory=lambda: Batches.live)
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
