"""bench/thread_cpu.py (the per-thread diagnostic of bench/kafka_io.py --per-thread): CPU lands on
the thread that spent it, a thread that ends after a reading keeps what that reading saw, and a
thread born and ended between readings is not lost (it is the process's rest)."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

# Loaded by path: bench/ on sys.path would let bench/capacity.py shadow the capacity package.
_spec = importlib.util.spec_from_file_location(
    "bench_thread_cpu", Path(__file__).resolve().parents[2] / "bench" / "thread_cpu.py")
thread_cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(thread_cpu)


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_cpu_is_attributed_to_the_thread_that_spent_it():
    cpu = thread_cpu.ThreadCpu()
    release = threading.Event()
    named = threading.Thread(target=lambda: (_spin(0.3), release.wait()))
    cpu.start()
    named.start()
    try:
        cpu.name(named, "busy helper")
        _spin(0.2)  # the calling thread: the sender's role
        while named.is_alive() and thread_cpu.thread_times()[named.native_id][1] < 0.25:
            time.sleep(0.01)
        result = cpu.stop()
    finally:
        release.set()
        named.join()
    assert 0.15 <= result["sender thread"] <= 0.45
    assert 0.15 <= result["busy helper"] <= 0.45


def test_a_thread_ended_after_a_mark_keeps_its_cpu_and_one_ended_between_readings_is_the_rest():
    cpu = thread_cpu.ThreadCpu()
    cpu.start()
    release = threading.Event()
    marked = threading.Thread(target=lambda: (_spin(0.2), release.wait()))
    marked.start()
    cpu.name(marked, "seen by a mark")
    while thread_cpu.thread_times()[marked.native_id][1] < 0.15:
        time.sleep(0.01)
    cpu.mark()
    release.set()  # it ends now, before stop()'s reading
    marked.join()
    unseen = threading.Thread(target=_spin, args=(0.2,))  # born and ended with no reading
    unseen.start()
    unseen.join()
    result = cpu.stop()
    assert result["seen by a mark"] >= 0.15
    # Not lost: the rest of the process's CPU, or "other threads" if the kernel still listed it
    # (join() returns a moment before the thread is gone from /proc).
    assert result[thread_cpu.ENDED] + result.get("other threads", 0.0) >= 0.15, result


def test_the_table_gives_microseconds_a_record_per_role_and_side():
    runs = {"raw": [{"sender thread": 0.6}, {"sender thread": 0.9}],
            "adapter": [{"sender thread": 1.2, "span export thread": 0.3},
                        {"sender thread": 1.5, "span export thread": 0.1}]}
    lines = thread_cpu.median_table(runs, per=100_000)
    assert lines[1].split() == ["sender", "thread", "7.50", "13.50"]
    assert lines[2].split() == ["span", "export", "thread", "0.00", "2.00"]
