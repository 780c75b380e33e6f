"""``--intake partition``: a consumer group over the conversation_id-keyed request topics.

One conversation's turns reach the same worker (its cache could be reused). Backpressure is
``pause``/``resume``: while the worker has no free slot the fetcher stops for good (nothing is
prefetched into memory), so memory stays bounded however deep the backlog. The batch topic's
partitions are paused whenever ``Capacity`` gives batch work no room (interactive first).

Offsets: each partition commits up to its lowest unfinished offset (``OffsetTracker``), only for
items whose Response is durable, with the crash counts of its records not finished yet as the
commit's metadata (``CrashCounts``: a record that crashed the worker too often is dead-lettered);
a position counts as committed once the broker confirms it (``on_commit``), and a failed commit is
sent again. On revoke, finished work is committed, then
the items of the revoked partitions are flagged and handed to the worker to stop, uncommitted:
the new owner serves them again. Both consumers (one group per priority class) are owned by one
thread; rebalance hooks run inside their polls. If that thread dies, ``failed`` tells the worker,
which stops (it cannot take or commit anything more).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from inference.worker.capacity import Capacity
from inference.worker.crash_counts import CrashCounts
from inference.worker.errors import PoisonRecordError
from inference.worker.intake import Intake, Outcome, WorkItem, decode_item, request_topics
from inference.worker.offsets import OffsetTracker
from inference.worker.settings import WorkerSettings
from schemas.codec import AvroCodec
from schemas.records import Priority, now_ms
from transport.errors import TransportError
from transport.group_reader import GroupReader
from transport.settings import IDLE_FETCH_WAIT_MS, KafkaSettings

log = logging.getLogger(__name__)

# With fewer free slots than assigned partitions, only a window of as many partitions as there
# are slots is fetched from, rotated least-recently-visited first: after every pause/resume
# librdkafka refetches and hands out the lowest partitions first, so without a window the same
# few partitions would take every free slot and the others starve under sustained load (seen:
# requests of partitions 4-5 waiting ~58 s while later ones of 0-3 were served). A partition leaves
# the window once a record was taken from it (it had its turn) or after WINDOW_S without one (it was
# empty); the least recently visited partitions fill the free places.
WINDOW_S = 1.0
COMMIT_RETRY_S = 1.0  # after a commit that failed at once, wait this long before the next try


def partition_group_ids(settings: WorkerSettings) -> dict[Priority, str]:
    return {Priority.INTERACTIVE: settings.group_id, Priority.BATCH: f"{settings.group_id}.batch"}


class PartitionIntake(Intake):
    def __init__(self, kafka: KafkaSettings, settings: WorkerSettings, capacity: Capacity, codec: AvroCodec) -> None:
        super().__init__(kafka, settings, capacity, codec)
        self.topics = request_topics(kafka)
        self.tracker = OffsetTracker()
        self.crashes = CrashCounts()
        self._finished: queue.SimpleQueue[tuple[WorkItem, Outcome]] = queue.SimpleQueue()
        self._crashed: queue.SimpleQueue[tuple[WorkItem, str]] = queue.SimpleQueue()
        self._items: dict[tuple[str, int, int], WorkItem] = {}
        self._paused: set[tuple[str, int]] = set()
        self._unknown: set[tuple[str, int]] = set()  # assigned; pause state to be set
        # While slots are few: per priority, the partitions fetched from -> when each joined the window.
        self._windows: dict[Priority, dict[tuple[str, int], float]] = {}
        self._visited: dict[tuple[str, int], float] = {}  # when each partition was last in a window
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumers: dict[Priority, GroupReader] = {}
        self._error: BaseException | None = None
        self._commit_after = 0.0  # monotonic; commits wait until then after a failed one

    # -- called from the event loop ----------------------------------------------------------------

    def _start_threads(self) -> None:
        # One group per priority class: a group's assignor balances partition counts over all
        # its topics, so one group on both topics could give one worker every interactive
        # partition and the other every batch partition.
        self._consumers = {
            priority: GroupReader(
                self.kafka, group_id=group, topics=[topic],
                on_assign=self._on_assign, on_revoke=self._on_revoke, on_commit=self._on_commit,
                error_budget_s=self.settings.kafka_error_budget_s, tracer=self.tracer,
                extra_config={
                    "session.timeout.ms": self.settings.session_timeout_ms,
                    "heartbeat.interval.ms": max(500, self.settings.session_timeout_ms // 6),
                    # A waiting fetch returns when a record is appended; this bounds an idle one only
                    # (5 ms made ~200 idle fetches a second, same latency: bench/kafka_hop.py).
                    "fetch.wait.max.ms": IDLE_FETCH_WAIT_MS,
                    "queued.max.messages.kbytes": 1024,  # prefetch bound per consumer
                    "fetch.queue.backoff.ms": 1,
                })
            for topic, priority in self.topics.items()
            for group in [partition_group_ids(self.settings)[priority]]
        }
        self._thread = threading.Thread(target=self._run, name="chatpipe-intake", daemon=True)
        self._thread.start()

    def finish(self, item: WorkItem, outcome: Outcome) -> None:
        self._finished.put((item, outcome))
        self.capacity.notify()

    def record_crash(self, item: WorkItem, reason: str) -> None:
        self._crashed.put((item, reason))
        self.capacity.notify()

    def close(self) -> None:
        """Commit what is finished, leave the group (blocking: run it off the event loop)."""
        self._stop.set()
        self.capacity.notify()
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error

    # -- the intake thread -------------------------------------------------------------------------

    def _run(self) -> None:
        interactive, batch = self._consumers[Priority.INTERACTIVE], self._consumers[Priority.BATCH]
        try:
            while not self._stop.is_set():
                self._apply_crashes()
                self._apply_finished()
                self._commit_finished()
                plan = self.capacity.plan()
                room_i = plan.interactive if self.taking else 0
                room_b = plan.batch if self.taking else 0
                self._set_active(Priority.INTERACTIVE, self._window(Priority.INTERACTIVE, room_i))
                self._set_active(Priority.BATCH, self._window(Priority.BATCH, room_b))
                if room_i <= 0:  # nothing may come in: serve callbacks, wait for a free slot
                    interactive.poll_messages(1, 0)
                    batch.poll_messages(1, 0)
                    self.capacity.wait_change(self.settings.poll_timeout_s)
                    continue
                # The interactive poll is the one that waits (it returns as soon as a record
                # comes); batch records are picked up right after it without waiting.
                for message in self._outside_window(interactive, Priority.INTERACTIVE,
                                                    interactive.poll_messages(room_i, self.settings.poll_timeout_s)):
                    self._take(message, Priority.INTERACTIVE)
                room_b = self.capacity.plan().batch if self.taking else 0
                polled = batch.poll_messages(room_b, 0) if room_b > 0 else batch.poll_messages(1, 0)
                for message in self._outside_window(batch, Priority.BATCH, polled):
                    self._take(message, Priority.BATCH)
            self._apply_crashes()
            self._apply_finished()
            for consumer in self._consumers.values():
                self._commit(consumer, asynchronous=False, also=self.crashes.unsaved())
        except BaseException as exc:  # reported to the worker now, raised again by close()
            log.exception("partition intake failed")
            self._error = exc
            if not self._stop.is_set():
                self.report_failure(exc)
        finally:
            for consumer in self._consumers.values():
                consumer.close()

    # -- commits (intake thread) -------------------------------------------------------------------

    def _commit(self, consumer: GroupReader, *, asynchronous: bool, also: set[tuple[str, int]] = frozenset()) -> None:
        """Commit the positions of ``consumer``'s partitions that moved, and of those in ``also`` (crash
        counts to save) where they did not, each with its crash counts. Synchronous: marked committed
        on return; asynchronous: when the broker's answer comes (``_on_commit``, inside a poll)."""
        offsets = self.tracker.committable(consumer.topics)
        for tp in also:
            if tp[0] in consumer.topics and tp not in offsets and (position := self.tracker.position(tp)) is not None:
                offsets[tp] = position
        if not offsets:
            return
        metadata = {tp: self.crashes.metadata(tp, offset) for tp, offset in offsets.items()}
        try:
            consumer.commit_offsets(offsets, asynchronous=asynchronous, metadata=metadata)
        except TransportError:
            for tp, offset in offsets.items():
                self.tracker.commit_failed(tp, offset)
            raise
        if not asynchronous:
            for tp, offset in offsets.items():
                self.tracker.commit_succeeded(tp, offset)
                self.crashes.saved(tp)

    def _apply_crashes(self) -> None:
        """Count the crashes the worker reported and save them at once (a synchronous commit): the
        worker is about to stop, and a count lost now would let the record crash it once more."""
        counted = False
        while not self._crashed.empty():  # the intake thread is its only reader
            item, reason = self._crashed.get_nowait()
            if item.revoked:  # its partition is someone else's now: they serve it (and count) again
                continue
            crash = self.crashes.add(item.partition, item.message.offset, reason)
            counted = True
            log.warning("%s[%d]@%d made the worker crash (%d of %d before it is dead-lettered): %s", item.message.topic,
                        item.message.partition, item.message.offset, crash.count, self.settings.max_record_crashes,
                        reason)
        if not counted:
            return
        for consumer in self._consumers.values():
            try:
                self._commit(consumer, asynchronous=False, also=self.crashes.unsaved())
            except TransportError:  # saved by a later commit, or the worker's last one as it stops
                log.warning("could not save the crash count now; trying again with the next commit", exc_info=True)

    def _commit_finished(self) -> None:
        if time.monotonic() < self._commit_after:
            return
        for consumer in self._consumers.values():
            try:
                self._commit(consumer, asynchronous=True)
            except TransportError:  # offered again after COMMIT_RETRY_S; the group's troubles show in polls
                log.warning("commit failed; trying again in %.0f s", COMMIT_RETRY_S, exc_info=True)
                self._commit_after = time.monotonic() + COMMIT_RETRY_S

    def _on_commit(self, done: dict[tuple[str, int], int], failed: dict[tuple[str, int], int]) -> None:
        for tp, offset in done.items():
            self.tracker.commit_succeeded(tp, offset)
        for tp, offset in failed.items():
            self.tracker.commit_failed(tp, offset)  # offered again on the next loop turn

    def _take(self, message, priority: Priority) -> None:
        log.debug("took %s[%s]@%s", message.topic, message.partition, message.offset)
        item = decode_item(self.codec, message, priority, now_ms())
        tp = (message.topic, message.partition)
        if not self.crashes.known(tp):  # first record of the partition since it was assigned
            self.crashes.load(tp, self._consumers[priority].committed_metadata(tp))
        crash = self.crashes.get(tp, message.offset)
        limit = self.settings.max_record_crashes
        if crash is not None and crash.count >= limit and item.error is None:
            item.error = PoisonRecordError(f"it made the worker crash {crash.count} times (limit {limit}); the "
                                           f"last time: {crash.reason}")
        key = (message.topic, message.partition, message.offset)
        item.handle = key
        window = self._windows.get(priority)
        if window is not None and window.pop((message.topic, message.partition), None) is not None:
            self._visited[(message.topic, message.partition)] = time.monotonic()  # it had its turn
        self._items[key] = item
        self.tracker.taken(item.partition, message.offset)
        self.capacity.take(priority)
        self.hand_over(item)

    def _apply_finished(self) -> None:
        while not self._finished.empty():  # the intake thread is its only reader
            item, outcome = self._finished.get_nowait()
            # Identity, not the key: after a revoke and a re-assign the same offset can be taken
            # again by a new item before the old one finishes; the old finish must not remove the
            # new item (its own finish would then be dropped and the position never move again).
            if item.revoked or self._items.get(item.handle) is not item:
                continue  # its partition was revoked: not ours to commit
            del self._items[item.handle]
            if outcome is not Outcome.HAND_BACK:
                self.tracker.finished(item.partition, item.message.offset)

    def _window(self, priority: Priority, room: int) -> set[tuple[str, int]]:
        """The partitions of ``priority`` to fetch from now (see ``WINDOW_S``): none without room, all
        when every partition can have a slot, else a window of ``room`` partitions taking turns."""
        mine = set(self._consumers[priority].assignment)
        if room <= 0:
            return set()
        if room >= len(mine):
            self._windows.pop(priority, None)
            return mine
        now = time.monotonic()
        window = self._windows.setdefault(priority, {})
        for tp, joined in list(window.items()):
            if tp not in mine or now - joined > WINDOW_S:  # revoked, or nothing came: its turn is over
                del window[tp]
        for tp in sorted(window, key=window.get)[room:]:  # fewer slots now: the newest wait
            del window[tp]
        for tp in sorted(mine - window.keys(), key=lambda tp: self._visited.get(tp, 0.0))[:room - len(window)]:
            window[tp] = self._visited[tp] = now
        return set(window)

    def _outside_window(self, consumer: GroupReader, priority: Priority, messages: list) -> list:
        """``messages`` minus those of partitions outside the current window and all but the first of
        each window partition; their partitions are rewound (seek) to be read again in their turn:
        librdkafka hands out what it prefetched of a partition even after it is paused, which would
        let the lowest partitions take every slot again."""
        window = self._windows.get(priority)
        if window is None:
            return messages
        keep, kept, rewound = [], set(), set()
        for message in messages:
            tp = (message.topic, message.partition)
            if tp in window and tp not in kept and tp not in rewound:  # one record per partition and turn
                keep.append(message)
                kept.add(tp)
            elif tp not in rewound:  # the first one of its partition: read again from here later
                try:
                    consumer.seek(message.topic, message.partition, message.offset)
                    rewound.add(tp)
                except Exception:  # noqa: BLE001 - cannot rewind (e.g. mid-rebalance): take it, fairness is best effort
                    keep.append(message)
            # later records of a rewound partition: dropped here, read again after the first
        return keep

    def _set_active(self, priority: Priority, active: set[tuple[str, int]]) -> None:
        """Resume the ``active`` partitions of ``priority``, pause the rest (only what changes)."""
        consumer = self._consumers[priority]
        mine = set(consumer.assignment)
        unknown = mine & self._unknown
        pause = ((mine - active) - self._paused) | (unknown - active)
        resume = ((mine & active) & self._paused) | (unknown & active)
        consumer.pause(pause)
        consumer.resume(resume)
        self._paused = (self._paused | pause) - resume
        self._unknown -= unknown
        if pause or resume:
            log.debug("paused %s, resumed %s", sorted(pause), sorted(resume))

    # -- rebalance hooks (inside poll, on the intake thread) -------------------------------------

    def _on_assign(self, partitions: list[tuple[str, int]]) -> None:
        log.info("assigned %s", partitions)
        # librdkafka keeps a partition's pause flag across revoke and re-assign: set it explicitly
        # on the next loop turn, whatever it was (a stale pause would stall the partition forever).
        self._paused.difference_update(partitions)
        self._unknown.update(partitions)

    def _on_revoke(self, partitions: list[tuple[str, int]]) -> None:
        log.info("revoked %s", partitions)
        self._apply_finished()
        gone = set(partitions)
        consumer = next(c for c in self._consumers.values() if partitions[0][0] in c.topics) if partitions else None
        try:
            if consumer is not None:
                self._commit(consumer, asynchronous=False, also=self.crashes.unsaved())
        except Exception:  # the group moved on; the new owner re-serves them
            log.warning("commit on revoke failed; the new owner will serve those requests again", exc_info=True)
        stopped = [item for key, item in self._items.items() if (key[0], key[1]) in gone]
        for item in stopped:
            item.revoked = True
            del self._items[item.handle]
        self.tracker.forget(partitions)
        self.crashes.forget(partitions)
        self._paused.difference_update(partitions)
        if stopped:
            self._loop.call_soon_threadsafe(self._revoked_cb, stopped)
