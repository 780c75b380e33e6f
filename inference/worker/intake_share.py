"""``--intake share``: Kafka share groups (KIP-932), the least-loaded pull.

Any worker with a free slot takes the next request, whatever its partition or conversation.

Acknowledgements are explicit and per record:
- ACCEPT once the request's Response is durable; REJECT once its dead letter is durable;
- RELEASE for records beyond the free slots (a poll can return a whole producer batch), and on
  shutdown for what was not finished, so another worker takes them. Each release costs the
  record a delivery attempt, so a member holds a few over-delivered records (``hold_limit``) for
  up to ``share_hold_s`` and starts them as slots free, and releases the rest at once;
- a record delivered more than ``max_delivery_attempts`` times is answered (an error final chunk
  to its reply address when it decodes, an error Response), goes to the DLQ with the count,
  then REJECT.

The record lock: a record is acquired for the group's ``share.record.lock.duration.ms``
(``share_record_lock_ms``, 60 s) and the client cannot renew it (``transport.share_reader``).
A generation still running when the lock runs out would be handed to another worker while it
still runs here. So each item carries ``lock_until_ms`` (acquisition + lock - ``share_lock_margin_ms``,
5 s: what the stopped generation's Response and its ACCEPT need)
and the worker stops a generation at that moment (finish TIMEOUT); see docs/worker.md for the
measured longest generation.

librdkafka refuses a poll while records of the previous poll are unacknowledged, and a
generation holds its record for seconds. So each priority class has a small pool of share
consumers ("members"), each in its own thread: a member polls only when all its records are
acknowledged, takes what ``Capacity`` allows and releases the rest. The batch members take
nothing while an interactive request waits (interactive first). ``fetch.max.bytes`` is kept
small so a poll brings few records beyond what is taken: every release costs the record a
delivery attempt.

The group configs (``share.auto.offset.reset=earliest``, the record lock, a broker-side
delivery limit above ours) are set through the admin API at start. A member thread that dies
reports it through ``failed``: the worker stops.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from inference.worker.capacity import Capacity
from inference.worker.errors import TooManyDeliveriesError
from inference.worker.intake import Intake, Outcome, WorkItem, decode_item, request_topics
from inference.worker.settings import WorkerSettings
from schemas.codec import AvroCodec
from schemas.records import Priority, now_ms
from transport.admin import TopicAdmin
from transport.settings import KafkaSettings
from transport.share_reader import ACCEPT, REJECT, RELEASE, ShareGroupReader, SharedMessage

log = logging.getLogger(__name__)

ACK_OF = {Outcome.DONE: ACCEPT, Outcome.DEAD: REJECT, Outcome.HAND_BACK: RELEASE}


def share_group_config(settings: WorkerSettings) -> dict[str, str]:
    return {
        "share.auto.offset.reset": "earliest",  # else a new group skips what already waits
        # How long a generation may hold its record (the worker stops one that would outlive it).
        "share.record.lock.duration.ms": str(settings.share_record_lock_ms),
        # The broker archives a record silently at its own limit: keep it above ours, so we
        # dead-letter first (with the count) instead.
        "share.delivery.count.limit": str(min(10, settings.max_delivery_attempts + 2)),
    }


def share_group_ids(settings: WorkerSettings) -> dict[Priority, str]:
    """Not the partition intake's consumer group ids: Kafka refuses a share group whose id is (or
    was) a consumer group's, so a switch of ``--intake`` with the same ``group_id`` failed."""
    return {Priority.INTERACTIVE: f"{settings.group_id}.share", Priority.BATCH: f"{settings.group_id}.share.batch"}


class _Member:
    """One share consumer and its thread; holds at most one poll's records at a time."""

    def __init__(self, owner: "ShareIntake", priority: Priority, topic: str, n: int) -> None:
        self.owner = owner
        self.priority = priority
        self.topic = topic
        self.acks: queue.SimpleQueue[tuple[SharedMessage, Outcome]] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.outstanding = 0  # records of the last poll dispatched and not acknowledged yet
        # polled, not started yet: (record, when it was polled (monotonic), when its lock ends (epoch ms))
        self.held: list[tuple[SharedMessage, float, int]] = []
        self.consumer: ShareGroupReader | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.run, name=f"chatpipe-share-{priority.value.lower()}-{n}",
                                       daemon=True)

    def run(self) -> None:
        o = self.owner
        try:
            self.consumer = ShareGroupReader(o.kafka, group_id=share_group_ids(o.settings)[self.priority],
                                               topics=[self.topic], fetch_max_bytes=o.settings.share_fetch_max_bytes,
                                               error_budget_s=o.settings.kafka_error_budget_s,
                                               extra_config={"fetch.wait.max.ms": 5}, tracer=o.tracer)
            while not o.stopping.is_set():
                self.apply_acks()
                if self.held:
                    self.start_held()
                if self.held:  # waiting for a free slot
                    o.capacity.wait_change(o.settings.poll_timeout_s)
                    continue
                if self.outstanding > 0:
                    self.wake.wait(o.settings.poll_timeout_s * 4)
                    self.wake.clear()
                    continue
                if not o.taking or not o.has_room(self.priority):
                    o.capacity.wait_change(o.settings.poll_timeout_s)
                    continue
                # One member of a class polls at a time: several polling for the same free slot
                # would acquire records only to release them (each release costs a delivery).
                if not o.poll_locks[self.priority].acquire(timeout=o.settings.poll_timeout_s):
                    continue
                try:
                    if o.has_room(self.priority):
                        messages = self.consumer.poll_messages(o.settings.poll_timeout_s)
                        if messages:
                            self.take(messages)
                finally:
                    o.poll_locks[self.priority].release()
            self.apply_acks()
            self.release_held(all_of_them=True)
            self.consumer.commit(asynchronous=False)
        except BaseException as exc:  # reported to the worker now, raised again by close()
            log.exception("share intake member %s failed", self.thread.name)
            self.error = exc
            if not o.stopping.is_set():
                o.report_failure(exc)
        finally:
            if self.consumer is not None:
                self.consumer.close()

    def take(self, messages: list[SharedMessage]) -> None:
        o = self.owner
        released: list[SharedMessage] = []
        lock_until = now_ms() + o.settings.share_record_lock_ms - o.settings.share_lock_margin_ms  # acquired just now
        for message in messages:
            count = message.delivery_count
            if count > o.settings.max_delivery_attempts:
                o.capacity.take(self.priority)  # an answer and a dead letter to write: tiny, always taken
                self.dispatch(message, lock_until, TooManyDeliveriesError(
                    f"delivered {count} times (limit {o.settings.max_delivery_attempts}); "
                    "it failed or was handed back every time"))
            elif o.taking and o.capacity.try_take(self.priority):
                self.dispatch(message, lock_until)
            elif o.taking and len(self.held) < o.hold_limit:
                # A poll hands out whole producer batches (asked 3, got 30): each record released
                # now costs it a delivery attempt when it is acquired again, so a few are held for
                # a moment, to start here as slots free up.
                self.held.append((message, time.monotonic(), lock_until))
            else:  # beyond our free slots: someone else's
                released.append(message)
        self.release(released)

    def dispatch(self, message: SharedMessage, lock_until_ms: int, error: Exception | None = None) -> None:
        item = decode_item(self.owner.codec, message, self.priority, now_ms())
        item.delivery_count = message.delivery_count
        item.lock_until_ms = lock_until_ms
        if error is not None:  # the worker answers it (when it decoded) and dead-letters it with this reason
            item.error = error
        item.handle = self
        self.outstanding += 1
        self.owner.hand_over(item)

    def start_held(self) -> None:
        o = self.owner
        while self.held and o.taking and o.capacity.try_take(self.priority):
            message, _, lock_until = self.held.pop(0)
            self.dispatch(message, lock_until)
        self.release_held(all_of_them=not o.taking)

    def release_held(self, *, all_of_them: bool = False) -> None:
        """RELEASE held records: all of them, or those held longer than ``share_hold_s`` (another
        worker may be free; the lock must not run out while they wait here)."""
        limit = time.monotonic() - self.owner.settings.share_hold_s
        gone = [held[0] for held in self.held if all_of_them or held[1] <= limit]
        self.held = [held for held in self.held if not all_of_them and held[1] > limit]
        self.release(gone)

    def release(self, messages: list[SharedMessage]) -> None:
        """RELEASE ``messages``: another worker takes them (each release costs a delivery attempt)."""
        for message in messages:
            self.consumer.acknowledge(message, RELEASE)
        if messages:
            self.owner.released += len(messages)
            self.consumer.commit(asynchronous=True)

    def apply_acks(self) -> None:
        if self.acks.empty():
            return
        while not self.acks.empty():  # this member's thread is its only reader
            message, outcome = self.acks.get_nowait()
            self.consumer.acknowledge(message, ACK_OF[outcome])
            self.outstanding -= 1
        self.consumer.commit(asynchronous=True)


class ShareIntake(Intake):
    def __init__(self, kafka: KafkaSettings, settings: WorkerSettings, capacity: Capacity, codec: AvroCodec) -> None:
        super().__init__(kafka, settings, capacity, codec)
        self.stopping = threading.Event()
        self.released = 0  # records given back because they exceeded free capacity
        self.poll_locks = {p: threading.Lock() for p in (Priority.INTERACTIVE, Priority.BATCH)}
        topics = {p: t for t, p in request_topics(kafka).items()}
        pool = settings.share_consumers or max(1, capacity.max_in_flight // 2)
        self.hold_limit = max(1, capacity.max_in_flight // pool)  # held per member, not started yet
        self.members = [_Member(self, p, topics[p], n) for p in (Priority.INTERACTIVE, Priority.BATCH)
                        for n in range(pool)]

    def has_room(self, priority: Priority) -> bool:
        plan = self.capacity.plan()
        return (plan.interactive if priority is Priority.INTERACTIVE else plan.batch) > 0

    def _start_threads(self) -> None:
        admin = TopicAdmin(self.kafka)
        for group in share_group_ids(self.settings).values():
            admin.set_share_group_config(group, share_group_config(self.settings))
        for member in self.members:
            member.thread.start()

    def finish(self, item: WorkItem, outcome: Outcome) -> None:
        member: _Member = item.handle
        member.acks.put((item.message, outcome))
        member.wake.set()
        self.capacity.notify()

    def close(self) -> None:
        self.stopping.set()
        self.capacity.notify()
        for member in self.members:
            member.wake.set()
            member.thread.join()
        log.info("share intake closed; %d record(s) were released for lack of free slots", self.released)
        errors = [m.error for m in self.members if m.error is not None]
        if errors:
            raise errors[0]
