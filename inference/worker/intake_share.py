"""``--intake share``: Kafka share groups (KIP-932), the least-loaded pull.

Any worker with a free slot takes the next request, whatever its partition or conversation.

Acknowledgements are explicit and per record:
- ACCEPT once the request's Response is durable; REJECT once its dead letter is durable;
- RELEASE for records beyond the free slots (a poll can return a whole producer batch), and on
  shutdown for what was not finished, so another worker takes them. Each release costs the
  record a delivery attempt, so a member holds a few over-delivered records (``hold_limit``) for
  up to ``share_hold_s`` and starts them as slots free, and releases the rest at once;
- a record delivered more than ``max_delivery_attempts`` times goes to the DLQ with the count,
  then REJECT.

librdkafka refuses a poll while records of the previous poll are unacknowledged, and a
generation holds its record for seconds. So each priority class has a small pool of share
consumers ("members"), each in its own thread: a member polls only when all its records are
acknowledged, takes what ``Capacity`` allows and releases the rest. The batch members take
nothing while an interactive request waits (interactive first). ``fetch.max.bytes`` is kept
small so a poll brings few records beyond what is taken: every release costs the record a
delivery attempt.

The group configs (``share.auto.offset.reset=earliest``, a longer record lock, a broker-side
delivery limit above ours) are set through the admin API at start.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Callable

from inference.worker.capacity import Capacity
from inference.worker.errors import TooManyDeliveriesError
from inference.worker.intake import Outcome, WorkItem, decode_item, request_topics
from inference.worker.settings import WorkerSettings
from schemas.codec import AvroCodec
from schemas.records import Priority, now_ms
from transport.admin import TopicAdmin
from transport.settings import KafkaSettings
from transport.share_consumer import ACCEPT, REJECT, RELEASE, ShareGroupConsumer, SharedMessage

log = logging.getLogger(__name__)

ACK_OF = {Outcome.DONE: ACCEPT, Outcome.DEAD: REJECT, Outcome.HAND_BACK: RELEASE}


def share_group_config(settings: WorkerSettings) -> dict[str, str]:
    return {
        "share.auto.offset.reset": "earliest",  # else a new group skips what already waits
        "share.record.lock.duration.ms": "60000",  # a generation may hold a record this long
        # The broker archives a record silently at its own limit: keep it above ours, so we
        # dead-letter first (with the count) instead.
        "share.delivery.count.limit": str(min(10, settings.max_delivery_attempts + 2)),
    }


def share_group_ids(settings: WorkerSettings) -> dict[Priority, str]:
    return {Priority.INTERACTIVE: settings.group_id, Priority.BATCH: f"{settings.group_id}.batch"}


class _Member:
    """One share consumer and its thread; holds at most one poll's records at a time."""

    def __init__(self, owner: "ShareIntake", priority: Priority, topic: str, n: int) -> None:
        self.owner = owner
        self.priority = priority
        self.topic = topic
        self.acks: queue.SimpleQueue[tuple[SharedMessage, Outcome]] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.outstanding = 0  # records of the last poll dispatched and not acknowledged yet
        self.held: list[tuple[SharedMessage, float]] = []  # polled, not started yet (monotonic time)
        self.consumer: ShareGroupConsumer | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.run, name=f"chatpipe-share-{priority.value.lower()}-{n}",
                                       daemon=True)

    def run(self) -> None:
        o = self.owner
        try:
            self.consumer = ShareGroupConsumer(o.kafka, group_id=share_group_ids(o.settings)[self.priority],
                                               topics=[self.topic], fetch_max_bytes=o.settings.share_fetch_max_bytes,
                                               extra_config={"fetch.wait.max.ms": 5})
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
        except BaseException as exc:  # noqa: BLE001 - surfaced by close()
            log.exception("share intake member %s failed", self.thread.name)
            self.error = exc
        finally:
            if self.consumer is not None:
                self.consumer.close()

    def take(self, messages: list[SharedMessage]) -> None:
        o = self.owner
        released = 0
        for message in messages:
            count = message.delivery_count
            if count > o.settings.max_delivery_attempts:
                o.capacity.take(self.priority)  # a dead letter to write: tiny, always taken
                item = WorkItem(message, self.priority, delivery_count=count, taken_at_ms=now_ms(),
                                error=TooManyDeliveriesError(
                                    f"delivered {count} times (limit {o.settings.max_delivery_attempts}); "
                                    "it failed or was handed back every time"))
            elif o.taking and o.capacity.try_take(self.priority):
                self.dispatch(message)
                continue
            elif o.taking and len(self.held) < o.hold_limit:
                # A poll hands out whole producer batches (asked 3, got 30): each record released
                # now costs it a delivery attempt when it is acquired again, so a few are held for
                # a moment, to start here as slots free up.
                self.held.append((message, time.monotonic()))
                continue
            else:
                self.consumer.acknowledge(message, RELEASE)  # beyond our free slots: someone else's
                released += 1
                continue
            item.handle = self
            self.outstanding += 1
            o.loop.call_soon_threadsafe(o.dispatch, item)
        if released:
            o.released += released
            self.consumer.commit(asynchronous=True)

    def dispatch(self, message: SharedMessage) -> None:
        item = decode_item(self.owner.codec, message, self.priority, now_ms())
        item.delivery_count = message.delivery_count
        item.handle = self
        self.outstanding += 1
        self.owner.loop.call_soon_threadsafe(self.owner.dispatch, item)

    def start_held(self) -> None:
        o = self.owner
        while self.held and o.taking and o.capacity.try_take(self.priority):
            self.dispatch(self.held.pop(0)[0])
        self.release_held(all_of_them=not o.taking)

    def release_held(self, *, all_of_them: bool = False) -> None:
        """RELEASE held records: all of them, or those held longer than ``share_hold_s`` (another
        worker may be free; the lock must not run out while they wait here)."""
        limit = time.monotonic() - self.owner.settings.share_hold_s
        keep = [(m, t) for m, t in self.held if not all_of_them and t > limit]
        gone = [m for m, t in self.held if all_of_them or t <= limit]
        for message in gone:
            self.consumer.acknowledge(message, RELEASE)
        self.held = keep
        if gone:
            self.owner.released += len(gone)
            self.consumer.commit(asynchronous=True)

    def apply_acks(self) -> None:
        sent = False
        while True:
            try:
                message, outcome = self.acks.get_nowait()
            except queue.Empty:
                break
            self.consumer.acknowledge(message, ACK_OF[outcome])
            self.outstanding -= 1
            sent = True
        if sent:
            self.consumer.commit(asynchronous=True)


class ShareIntake:
    def __init__(self, kafka: KafkaSettings, settings: WorkerSettings, capacity: Capacity, codec: AvroCodec) -> None:
        self.kafka = kafka
        self.settings = settings
        self.capacity = capacity
        self.codec = codec
        self.taking = True
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

    def start(self, loop: asyncio.AbstractEventLoop, dispatch: Callable[[WorkItem], None],
              revoked: Callable[[list[WorkItem]], None]) -> None:
        self.loop, self.dispatch = loop, dispatch
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

    def stop_taking(self) -> None:
        self.taking = False
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

    def lag(self) -> int:
        return -1  # a share group has no per-member position; watch the topic's backlog instead
