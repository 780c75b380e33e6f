"""Helpers of the streams integration tests: the worker as a subprocess, taps on topics.

The streams worker runs as the real ``chatpipe streams`` process (the same code path as
production, SIGTERM included), against the session's broker, under a topic prefix of its own so
no other test's prompts reach it. No inference worker is used: the tests answer each
``InferenceRequest`` themselves (tests/streams/stand_in.py).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from chatpipe.testing.processes import REPO, VENV_PYTHON, start_process, stop_process, wait_until
from schemas.codec import default_codec
from schemas.topics import spec
from streams.faults import EXIT_INFRASTRUCTURE
from transport import clients
from transport.settings import KafkaSettings


class StreamsWorker:
    """``chatpipe streams`` in a subprocess; its output goes to ``log``."""

    def __init__(self, kafka: KafkaSettings, root: Path, *, env: Mapping[str, str] = {}, **streams_env: Any) -> None:
        """``streams_env``: StreamsSettings fields (CHATPIPE_STREAMS_<NAME>); ``env``: any other variables
        (CHATPIPE_CACHE_URL, CHATPIPE_MEMORY_*)."""
        self.log = root / "worker.log"
        self.archive_dir = root / "archive"
        self.memory_dir = root / "qdrant"
        self.env = {**os.environ, "CHATPIPE_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
                    "CHATPIPE_TOPIC_PREFIX": kafka.topic_prefix, "CHATPIPE_STREAMS_STATE_DIR": str(root / "faust"),
                    "CHATPIPE_STREAMS_ARCHIVE_DIR": str(self.archive_dir), "CHATPIPE_STREAMS_ARCHIVE_FLUSH_S": "0.5",
                    "CHATPIPE_STREAMS_COMMIT_INTERVAL_S": "0.5", "CHATPIPE_MEMORY_PATH": str(self.memory_dir),
                    "HF_HUB_OFFLINE": "1", **{f"CHATPIPE_STREAMS_{k.upper()}": str(v) for k, v in streams_env.items()},
                    **env}
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.stall_restarts = 0
        self.uncommitted_stalls = 0  # stall exits whose pre-exit commit failed (restart_if_stalled)

    def start(self, timeout_s: float = 240.0) -> None:
        with open(self.log, "a") as out:
            out.write(f"\n===== start {self.starts} =====\n")
        self.proc = start_process([VENV_PYTHON, "-m", "chatpipe.cli", "streams"], log=self.log, env=self.env,
                                  cwd=REPO)
        self.starts += 1
        wait_until(lambda: "Ready" in self.current_log(), timeout_s=timeout_s, what="chatpipe streams",
                   proc=self.proc, log=self.tail, interval_s=0.3)

    def stop(self, timeout_s: float = 90.0) -> int:
        """SIGTERM and wait; returns the exit code (the worker must stop on its own)."""
        assert self.proc is not None
        try:
            return stop_process(self.proc, timeout_s)  # SIGKILL past the timeout
        except subprocess.TimeoutExpired:
            raise AssertionError(f"chatpipe streams did not stop within {timeout_s:.0f}s of SIGTERM:\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text().splitlines()[-lines:]) if self.log.exists() else ""

    def current_log(self) -> str:
        """What the current (last started) process logged."""
        return self.log.read_text().split(f"===== start {self.starts - 1} =====")[-1]

    def restart_if_stalled(self, limit: int = 2) -> bool:
        """Start the worker again, as ``chatpipe up``'s supervisor does, if its progress watchdog ended
        it on a stalled consumer (exit 75 with ``StalledConsumerError``: a Faust fetcher that stops
        fetching some assigned partitions after a restart, seen now and then on this 2-core VM;
        docs/streams.md "watchdog"). Before exiting, the worker commits what its agents acked, so the
        restart reads only the stalled partitions again and the tests' exactly-once counts still hold;
        a stall exit whose commit did not go through (it says so) is counted in ``uncommitted_stalls``:
        what it served since its last commit is served again (at-least-once). True when it restarted;
        a worker that stalls more than ``limit`` times fails the test."""
        if (self.proc is None or self.proc.poll() != EXIT_INFRASTRUCTURE
                or "StalledConsumerError" not in self.current_log()):
            return False
        if self.stall_restarts >= limit:
            raise AssertionError(f"chatpipe streams stalled {self.stall_restarts + 1} times:\n{self.tail()}")
        self.stall_restarts += 1
        if "committed the acknowledged offsets" not in self.current_log():
            self.uncommitted_stalls += 1
        print(f"chatpipe streams stalled (watchdog exit 75); restarting it as a supervisor would "
              f"({self.stall_restarts} of at most {limit})")
        self.start()
        return True

    def records(self, tap: "Tap", n: int, *, timeout_s: float = 60.0,
                where: Callable[[Any], bool] = lambda r: True) -> list:
        """``tap.records(n, ...)`` while this worker runs, restarting it if it stalls
        (``restart_if_stalled``); each restart gives the records ``timeout_s`` again."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return tap.records(n, timeout_s=min(5.0, max(0.0, deadline - time.monotonic())), where=where)
            except AssertionError:
                if self.restart_if_stalled():
                    deadline = time.monotonic() + timeout_s
                elif time.monotonic() >= deadline:
                    raise


class Tap:
    """Reads catalog topics from their beginning (assigned partitions, no consumer group).

    Everything read is kept (``history``), so a record passed over while waiting for another
    one can still be asked for later.
    """

    def __init__(self, kafka: KafkaSettings, *names: str) -> None:
        self.consumer = clients.consumer(kafka, "unused", {"enable.auto.commit": False,
                                                            "enable.partition.eof": False})
        self.consumer.assign([TopicPartition(kafka.topic(n), p, OFFSET_BEGINNING)
                              for n in names for p in range(spec(n).partitions)])
        self.codec = default_codec()
        self.history: list = []  # raw messages, in the order read
        self._returned: set[int] = set()

    def _read(self, timeout_s: float) -> int:
        batch = [m for m in self.consumer.consume(100, timeout_s) if m.error() is None]
        self.history.extend(batch)
        return len(batch)

    def messages(self, n: int, timeout_s: float = 60.0, where: Callable[[Any], bool] = lambda m: True) -> list:
        """The next ``n`` raw messages satisfying ``where`` that no call returned before."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [i for i, m in enumerate(self.history) if i not in self._returned and where(m)][:n]
            if len(found) == n:
                self._returned.update(found)
                return [self.history[i] for i in found]
            if time.monotonic() > deadline:
                raise AssertionError(f"got {len(found)} of {n} messages within {timeout_s:.0f}s")
            self._read(0.2)

    def records(self, n: int, timeout_s: float = 60.0, where: Callable[[Any], bool] = lambda r: True) -> list:
        """Like ``messages``, decoded."""
        decode = self.codec.decode
        return [decode(m.value()) for m in self.messages(n, timeout_s, lambda m: where(decode(m.value())))]

    def drain(self, quiet_s: float = 1.0) -> list:
        """Every message read so far plus what arrives until ``quiet_s`` passes without any."""
        while self._read(quiet_s):
            pass
        return list(self.history)

    def close(self) -> None:
        self.consumer.close()
