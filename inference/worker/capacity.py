"""How much work the worker may take now, per priority class. Pure policy plus a locked counter.

Interactive first: interactive requests may fill every in-flight slot; batch requests may fill
all but ``reserve`` of them, and none while an interactive request is still waiting for the
engine (taken, no token yet). So however deep the batch backlog, an interactive request finds
a free slot at once and then the engine's priority queue puts it ahead of waiting batch work.
Running generations are not preempted: an interactive request waits at most until one running
generation ends.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from schemas.records import Priority


@dataclass(frozen=True, slots=True)
class IntakePlan:
    interactive: int  # records of the interactive class that may be taken now
    batch: int  # records of the batch class that may be taken now


def plan_intake(*, interactive_in_flight: int, interactive_waiting: int, batch_in_flight: int,
                max_in_flight: int, batch_limit: int) -> IntakePlan:
    free = max(0, max_in_flight - interactive_in_flight - batch_in_flight)
    batch = 0 if interactive_waiting else min(free, max(0, batch_limit - batch_in_flight))
    return IntakePlan(interactive=free, batch=batch)


class Capacity:
    """In-flight counts shared by the intake thread(s) and the event loop."""

    def __init__(self, max_in_flight: int, batch_limit: int) -> None:
        self.max_in_flight = max_in_flight
        self.batch_limit = batch_limit
        self._lock = threading.Lock()
        self._in_flight = {Priority.INTERACTIVE: 0, Priority.BATCH: 0}
        self._interactive_waiting = 0
        self._changed = threading.Condition(self._lock)  # notified whenever a slot frees

    def notify(self) -> None:
        """Wake every intake thread waiting in ``wait_change`` (a slot freed, a stop asked)."""
        with self._lock:
            self._changed.notify_all()

    def wait_change(self, timeout_s: float) -> None:
        with self._lock:
            self._changed.wait(timeout_s)

    def plan(self) -> IntakePlan:
        with self._lock:
            return self._plan()

    def _plan(self) -> IntakePlan:  # under the lock
        return plan_intake(
            interactive_in_flight=self._in_flight[Priority.INTERACTIVE],
            interactive_waiting=self._interactive_waiting,
            batch_in_flight=self._in_flight[Priority.BATCH],
            max_in_flight=self.max_in_flight, batch_limit=self.batch_limit,
        )

    def try_take(self, priority: Priority) -> bool:
        """Take one slot of ``priority`` if the plan has room for it (atomic across threads)."""
        with self._lock:
            plan = self._plan()
            if (plan.interactive if priority is Priority.INTERACTIVE else plan.batch) <= 0:
                return False
            self._take(priority)
            return True

    def take(self, priority: Priority) -> None:
        with self._lock:
            self._take(priority)

    def _take(self, priority: Priority) -> None:  # under the lock
        self._in_flight[priority] += 1
        if priority is Priority.INTERACTIVE:
            self._interactive_waiting += 1

    def started(self, priority: Priority) -> None:
        """The request's first token came (it runs in the engine): no longer waiting."""
        if priority is Priority.INTERACTIVE:
            with self._lock:
                self._interactive_waiting = max(0, self._interactive_waiting - 1)
                self._changed.notify_all()

    def release(self, priority: Priority, started: bool) -> None:
        with self._lock:
            self._in_flight[priority] -= 1
            if priority is Priority.INTERACTIVE and not started:
                self._interactive_waiting = max(0, self._interactive_waiting - 1)
            self._changed.notify_all()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return sum(self._in_flight.values())
