"""Which thread of this process a measured loop's CPU went to (Linux ``/proc/self/task``).

A diagnostic for the benchmarks that report client CPU per message (bench/kafka_io.py
``--per-thread``): the sending thread, librdkafka's broker threads, the delivery-report thread, the
span export thread. The kernel keeps each thread's user+system time in clock ticks (10 ms on most
kernels), so a figure is only meaningful per record over a whole run (60,000 records resolve 0.17 us
a record), never per call.

A thread that ends before the last reading (a span recorder shut down inside the measured window)
keeps the value of the latest reading that saw it (``mark``); what threads born and ended between
two readings spent is the rest of the process's CPU, reported as ``ended before a reading``.
Not here: sampling, call stacks (use a profiler for those).
"""

from __future__ import annotations

import os
import statistics
import threading
import time

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
ENDED = "ended before a reading"


def thread_times() -> dict[int, tuple[str, float]]:
    """Each live thread of this process: thread id -> (kernel name, user+system CPU seconds)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # it ended between the listing and the read
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on: utime is 14, stime 15
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) * TICK_S)
    return out


class ThreadCpu:
    """CPU per thread role between ``start`` and ``stop``.

    ``roles`` names threads by id (``threading.Thread.native_id``); the rest are named by their
    kernel name (librdkafka names its own ``rdk:main``, ``rdk:broker1``, ...; every broker thread
    counts as ``librdkafka broker threads``); an unnamed Python thread is ``other threads``.
    """

    def __init__(self) -> None:
        self.roles: dict[int, str] = {}
        self._first: dict[int, tuple[str, float]] = {}
        self._last: dict[int, tuple[str, float]] = {}
        self._process0 = 0.0
        self.result: dict[str, float] = {}

    def start(self) -> None:
        self.roles = {threading.current_thread().native_id: "sender thread"}  # the caller sends
        self._process0 = time.process_time()
        self._first = self._last = thread_times()

    def name(self, thread: threading.Thread | None, role: str) -> None:
        if thread is not None and thread.native_id is not None:
            self.roles[thread.native_id] = role

    def mark(self) -> None:
        """A reading in between: threads that end before ``stop`` keep what this one saw."""
        self._last = {**self._last, **thread_times()}

    def stop(self) -> dict[str, float]:
        """CPU seconds per role since ``start``."""
        process = time.process_time() - self._process0
        self.mark()
        result: dict[str, float] = {}
        for tid, (name, cpu) in self._last.items():
            role = self.roles.get(tid) or _role_of(name)
            result[role] = result.get(role, 0.0) + cpu - self._first.get(tid, (name, 0.0))[1]
        result[ENDED] = max(0.0, process - sum(result.values()))
        self.result = result
        return result


def _role_of(kernel_name: str) -> str:
    if kernel_name.startswith("rdk:broker"):
        return "librdkafka broker threads"
    if kernel_name.startswith("rdk:"):
        return f"librdkafka {kernel_name[4:]} thread"
    return "other threads"


def median_table(runs: dict[str, list[dict[str, float]]], per: int) -> list[str]:
    """Lines of a table: for each side (``runs``: side -> its runs' ``stop()`` results), the median
    microseconds per record (``per`` records a run) of each role, the sides as columns."""
    sides = list(runs)
    roles = sorted({role for results in runs.values() for r in results for role in r},
                   key=lambda role: (role != "sender thread", role))
    lines = [f"  {'thread (median us a record)':34}" + "".join(f"{side:>16}" for side in sides)]
    for role in roles:
        cells = [statistics.median(r.get(role, 0.0) for r in runs[side]) * 1e6 / per for side in sides]
        if any(cell >= 0.05 for cell in cells):
            lines.append(f"  {role:34}" + "".join(f"{cell:16.2f}" for cell in cells))
    return lines
