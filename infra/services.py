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
import subprocess
import time
from contextlib import suppress
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
        with suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return False
    return True


def command_line(pid: int) -> str:
    """The process's command line, its arguments separated by NUL bytes ("" when it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def terminate(pid: int, timeout_s: float, sig: signal.Signals = signal.SIGTERM) -> bool:
    """Send ``sig`` and wait up to ``timeout_s`` for ``pid`` to exit; SIGKILL it if it has not (then wait
    up to 5 s more). True when it needed the SIGKILL."""
    os.kill(pid, sig)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive(pid):
        time.sleep(0.1)
    if not alive(pid):
        return False
    os.kill(pid, signal.SIGKILL)
    while alive(pid) and time.monotonic() < deadline + 5:
        time.sleep(0.05)
    return True


def spawn(argv: list[str], log_file: Path | str, *, cwd: Path | str | None = None, env: dict[str, str] | None = None,
          header: str = "") -> subprocess.Popen:
    """Start ``argv`` in a session of its own (it outlives the caller, and a signal to the caller's group
    spares it), stdout and stderr appended to ``log_file`` (its folder made if need be) after ``header``;
    stdin is /dev/null."""
    from infra.process_env import outside_env

    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    env = outside_env(os.environ if env is None else env)  # a re-executed caller's preloads stay its own
    with open(log_file, "ab") as out:
        out.write(header.encode())
        out.flush()
        return subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def write_atomically(path: Path, text: str, mode: int = 0o666) -> None:
    """``text`` into a new file beside ``path``, created with ``mode`` (0o600: readable by its owner only,
    from the first moment), then renamed over ``path``: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "w", encoding="utf-8") as out:
        out.write(text)
    tmp.replace(path)


def write_pid_file(path: Path, pid: int) -> None:
    """``"<pid> <start time>"``, replaced atomically (a reader never sees half a line)."""
    write_atomically(path, f"{pid} {start_time(pid) or '0'}\n")


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
    return pid if start_time(pid) == started and alive(pid) else None


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
        pid, began = self.pid(), time.monotonic()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return StopResult(self.name, "not running", None, 0.0)
        # Every service drains or cancels its work on SIGTERM, then exits.
        outcome = "killed" if terminate(pid, timeout_s) else "stopped"
        self.pid_file.unlink(missing_ok=True)
        return StopResult(self.name, outcome, pid, time.monotonic() - began)
