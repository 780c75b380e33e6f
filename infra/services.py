"""One background service of the local stack: its pid file, its log, how it is stopped.

A service is a detached ``python -m chatpipe.cli <cmd>`` process that the stack's supervisor
(``infra.supervisor``) starts in its own session, with stdout and stderr appended to
``<state>/logs/<name>.log`` and ``"<pid> <start time>"`` in ``<state>/run/<name>.pid``.
``ServiceProcess`` finds it from those files alone (any process may ask: ``status``, ``down``) and
stops it (SIGTERM, SIGKILL only after a timeout). Whether it is *healthy* is not known here: the
stack (``infra.stack``) asks each service in its own way.

Not here: what each service is started with (``infra.stack``), starting and restarting
(``infra.supervisor``), the Kafka broker (``infra.local_kafka``).
"""

from __future__ import annotations

import os
import signal
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


def start_time(pid: int) -> str | None:
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


def write_pid_file(path: Path, pid: int) -> None:
    """``"<pid> <start time>"``, replaced atomically (a reader never sees half a line)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(f"{pid} {start_time(pid) or '0'}\n")
    tmp.replace(path)


def pid_in(path: Path) -> int | None:
    """The pid a pid file names, running or not (``"<pid>"`` or ``"<pid> <start time>"``)."""
    try:
        return int(path.read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return None


def read_pid_file(path: Path) -> int | None:
    """The pid a ``write_pid_file`` file names, if that very process still runs."""
    try:
        pid_text, started = path.read_text().split()
        pid = int(pid_text)
    except (FileNotFoundError, ValueError):
        return None
    if start_time(pid) != started or not alive(pid):
        return None
    return pid


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

    def pid(self) -> int | None:
        """The service's pid if the process the pid file names still runs."""
        return read_pid_file(self.pid_file)

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
