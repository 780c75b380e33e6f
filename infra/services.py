"""One background service of the local stack: a detached ``python -m chatpipe.cli <cmd>`` process.

``ServiceProcess`` starts it (its own session, so it outlives ``chatpipe up``; stdout and stderr
to ``<state>/logs/<name>.log``), remembers it in ``<state>/run/<name>.pid`` and stops it
(SIGTERM, SIGKILL only after a timeout). Whether it is *healthy* is not known here: the stack
(``infra.stack``) asks each service in its own way.

Not here: what each service is started with (``infra.stack``), the Kafka broker (``infra.local_kafka``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from infra.settings import StackSettings


@dataclass(frozen=True, slots=True)
class StopResult:
    name: str
    outcome: str  # "stopped" (exited after SIGTERM) | "killed" (SIGKILL after the timeout) | "not running"
    pid: int | None
    seconds: float


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): with the pid,
    it names one process for good, so a recycled pid is never taken for our service."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie child of ours is reaped and counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    if state == "Z":
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        return False
    return True


def tail(path: Path, lines: int = 20) -> str:
    if not path.exists():
        return f"({path} does not exist)"
    text = path.read_bytes()[-64_000:].decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


class ServiceProcess:
    """The pid file, log file and process of the service ``name`` in one state folder."""

    def __init__(self, name: str, settings: StackSettings) -> None:
        self.name = name
        self.settings = settings
        self.pid_file = settings.run_dir / f"{name}.pid"
        self.log_file = settings.logs_dir / f"{name}.log"
        self._proc: subprocess.Popen | None = None

    def pid(self) -> int | None:
        """The service's pid if the process the pid file names still runs."""
        if self._proc is not None and self._proc.poll() is not None:
            return None  # our own child has exited; poll() reaped it and kept its exit code
        try:
            pid_text, started = self.pid_file.read_text().split()
            pid = int(pid_text)
        except (FileNotFoundError, ValueError):
            return None
        if _start_time(pid) != started or not alive(pid):
            return None
        return pid

    def start(self, command: list[str], env: dict[str, str] | None = None) -> int:
        """Start ``chatpipe <command...>`` in the background (``env`` added to ours); returns its pid."""
        self.settings.logs_dir.mkdir(parents=True, exist_ok=True)
        self.settings.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} chatpipe {' '.join(command)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "chatpipe.cli", *command],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})},
                start_new_session=True,  # outlives `chatpipe up`, not hit by its Ctrl-C; `down` stops it
            )
        started = _start_time(self._proc.pid) or "0"
        self.pid_file.write_text(f"{self._proc.pid} {started}\n")
        return self._proc.pid

    def exit_code(self) -> int | None:
        """The exit code if this object started the process and it has exited."""
        return self._proc.poll() if self._proc is not None else None

    def stop(self, timeout_s: float) -> StopResult:
        pid = self.pid()
        began = time.monotonic()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return StopResult(self.name, "not running", None, 0.0)
        os.kill(pid, signal.SIGTERM)  # every service drains or cancels its work on SIGTERM, then exits
        deadline = began + timeout_s
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.1)
        outcome = "stopped"
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
            outcome = "killed"
            while alive(pid) and time.monotonic() < deadline + 5:
                time.sleep(0.05)
        self.pid_file.unlink(missing_ok=True)
        return StopResult(self.name, outcome, pid, time.monotonic() - began)

    def log_tail(self, lines: int = 20) -> str:
        return tail(self.log_file, lines)
