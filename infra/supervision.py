"""What ``chatpipe up / down / status / restart / stop`` and the stack's supervisor say to each other.

The supervisor (``infra.supervisor``, run as ``chatpipe supervise``) owns the services' processes;
the commands never start one themselves. They talk through three files in ``<state>/run``:

- ``supervisor-spec.json`` (written by the commands, under ``supervisor.lock``; mode 0600 since it
  holds the environment): the services to run, each with its command line, environment, log and pid
  file, ``wanted`` (false: keep it stopped) and ``generation`` (raised by ``chatpipe restart``), and a
  ``revision`` raised on every write;
- ``supervisor.json`` (written by the supervisor, atomically): per service its state, pid, restarts,
  the last exits with their reason, time and last log lines, and the spec revision it has applied;
- ``supervisor.pid``: ``"<pid> <start time>"`` of the supervisor (``supervisor.running`` is locked while
  one lives, so a second one started by a concurrent ``up`` exits at once).

Also here: the restart policy (``Backoff``) and how an exit status reads (``exit_reason``), plain
logic; ``SupervisorClient``, the commands' side. Not here: the supervisor's loop (``infra.supervisor``),
what each service runs (``infra.stack``).
"""

from __future__ import annotations

import fcntl
import json
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

from infra.local_kafka import StackError
from infra.services import read_pid_file, spawn, tail, terminate, write_atomically
from infra.settings import StackSettings

SPEC_FILE = "supervisor-spec.json"
STATE_FILE = "supervisor.json"
PID_FILE = "supervisor.pid"
LOCK_FILE = "supervisor.lock"
RUNNING_FILE = "supervisor.running"  # flock-ed by the live supervisor: never two for one state folder
EXITS_KEPT = 10  # per service, newest last
LOG_LINES_KEPT = 20


class SupervisorError(StackError):
    """The supervisor did not start, or did not act on what was asked within its timeout."""


# --- the spec: what should run -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ServiceSpec:
    name: str
    argv: tuple[str, ...]
    env: dict[str, str]  # the whole environment of the service (that of the `chatpipe up` that asked)
    log_file: str  # stdout + stderr, appended
    pid_file: str  # "<pid> <start time>", written by the supervisor on every start
    cwd: str | None = None
    tail_file: str | None = None  # the log whose last lines an exit keeps (default: log_file)
    wanted: bool = True  # False: stopped on request (`chatpipe stop`), not restarted
    generation: int = 0  # raised by `chatpipe restart`: stop it (if it runs) and start it again


@dataclass(frozen=True, slots=True)
class Spec:
    revision: int = 0
    services: tuple[ServiceSpec, ...] = ()  # started in this order; stopped in reverse

    def get(self, name: str) -> ServiceSpec | None:
        return next((s for s in self.services if s.name == name), None)

    def put(self, service: ServiceSpec, order: tuple[str, ...]) -> "Spec":
        """This spec with ``service`` added or replaced, services sorted by ``order``."""
        others = [s for s in self.services if s.name != service.name]
        ranked = sorted([*others, service], key=lambda s: order.index(s.name) if s.name in order else len(order))
        return replace(self, services=tuple(ranked))

    def without(self, names: set[str]) -> "Spec":
        return replace(self, services=tuple(s for s in self.services if s.name not in names))

    def wanting(self, names: list[str], wanted: bool) -> "Spec":
        """``names`` to run (True) or to stop and keep stopped (False)."""
        return replace(self, services=tuple(replace(s, wanted=wanted) if s.name in names else s
                                            for s in self.services))

    def restarting(self, names: list[str]) -> "Spec":
        """``names`` to stop (if they run) and start again: wanted, with the next generation."""
        return replace(self, services=tuple(replace(s, wanted=True, generation=s.generation + 1)
                                            if s.name in names else s for s in self.services))

    @classmethod
    def from_json(cls, data: dict) -> "Spec":
        services = tuple(ServiceSpec(**{**s, "argv": tuple(s["argv"])}) for s in data.get("services", []))
        return cls(int(data.get("revision", 0)), services)


# --- the state: what runs, and how it ended before ------------------------------------------------
@dataclass(slots=True)
class ExitRecord:
    at: float  # wall clock (time.time()) of the exit
    reason: str  # "exited with code 1" | "killed by SIGKILL" | "could not start: ..." | ...
    code: int | None
    signal: str | None
    ran_s: float
    requested: bool  # stopped on request (stop, restart, shutdown): no restart with backoff follows
    log_tail: list[str] = field(default_factory=list)
    restart_at: float | None = None  # when the supervisor started it again (wall clock)
    delay_s: float | None = None  # the backoff it waited first


@dataclass(slots=True)
class ServiceState:
    name: str
    state: str = "stopped"  # "running" | "backoff" (waits to restart) | "stopping" | "stopped"
    pid: int | None = None
    started_at: float | None = None
    generation: int = 0  # the spec generation this run was started for
    restarts: int = 0  # starts after an exit nobody asked for (what Kubernetes counts as RESTARTS)
    adopted: bool = False  # found running when this supervisor started: its exit code cannot be known
    next_start_at: float | None = None  # while in backoff
    exits: list[ExitRecord] = field(default_factory=list)

    @property
    def last_exit(self) -> ExitRecord | None:
        return self.exits[-1] if self.exits else None

    @classmethod
    def from_json(cls, data: dict) -> "ServiceState":
        return cls(**{**data, "exits": [ExitRecord(**e) for e in data.get("exits", [])]})


@dataclass(slots=True)
class SupervisorState:
    pid: int
    started_at: float
    spec_revision: int = -1  # the last spec revision acted on
    phase: str = "running"  # "running" | "shutting down" | "stopped" | "released" | "idle"
    services: dict[str, ServiceState] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> "SupervisorState":
        services = {n: ServiceState.from_json(s) for n, s in data.get("services", {}).items()}
        return cls(**{**data, "services": services})


# --- the restart policy ---------------------------------------------------------------------------
@dataclass(slots=True)
class Backoff:
    """Delay before restarting a service that exited: ``initial_s`` doubling per exit up to ``max_s``;
    an exit after ``reset_after_s`` of running starts from ``initial_s`` again (it was not a crash loop)."""

    initial_s: float
    max_s: float
    reset_after_s: float
    failures: int = 0

    def next_delay(self, ran_s: float) -> float:
        if ran_s >= self.reset_after_s:
            self.failures = 0
        delay = min(self.initial_s * 2 ** self.failures, self.max_s)
        self.failures += 1
        return delay


def exit_reason(returncode: int) -> tuple[str, int | None, str | None]:
    """``Popen.returncode`` as (reason, exit code, signal name): -9 -> ("killed by SIGKILL", None, "SIGKILL")."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}", None, name
    meaning = EXIT_MEANINGS.get(returncode)
    return f"exited with code {returncode}" + (f" ({meaning})" if meaning else ""), returncode, None


# What the services' own exit codes say (docs/architecture.md "Failure policy"), shown in `status`.
EXIT_MEANINGS = {75: "infrastructure away past the retry budget, or a stalled or lost delivery", 70: "unexpected error"}


def happened(subject: str, reason: str) -> str:
    """A sentence of an exit reason: ("gateway", "killed by SIGKILL") -> "gateway was killed by SIGKILL"."""
    return f"{subject} was {reason}" if reason.startswith("killed") else f"{subject} {reason}"


# --- files ----------------------------------------------------------------------------------------
def _write_json(path: Path, data: dict, mode: int = 0o644) -> None:
    write_atomically(path, json.dumps(data, indent=1) + "\n", mode)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise SupervisorError(f"{path} cannot be read ({exc}); `chatpipe down` removes it") from None


def read_spec(run_dir: Path) -> Spec:
    data = _read_json(run_dir / SPEC_FILE)
    return Spec() if data is None else Spec.from_json(data)


def write_state(run_dir: Path, state: SupervisorState) -> None:
    _write_json(run_dir / STATE_FILE, asdict(state))


@contextmanager
def spec_lock(run_dir: Path) -> Iterator[None]:
    """Held while the spec is read, changed and written, and while the supervisor decides to exit."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LOCK_FILE, "a") as lock:  # closing it releases the lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# --- the commands' side ---------------------------------------------------------------------------
class SupervisorClient:
    """Start the supervisor of one state folder, change its spec and wait until it has acted."""

    def __init__(self, settings: StackSettings) -> None:
        self.settings = settings
        self.run_dir = settings.run_dir
        self.pid_file = self.run_dir / PID_FILE
        self.log_file = settings.logs_dir / "supervisor.log"

    def pid(self) -> int | None:
        return read_pid_file(self.pid_file)

    def state(self) -> SupervisorState | None:
        data = _read_json(self.run_dir / STATE_FILE)
        return None if data is None else SupervisorState.from_json(data)

    def spec(self) -> Spec:
        return read_spec(self.run_dir)

    def update(self, change: Callable[[Spec, bool], Spec]) -> tuple[Spec, bool]:
        """Apply ``change(spec, supervisor_runs)`` and save it with the next revision; start the
        supervisor if the spec wants something and none runs. Returns the spec and whether a
        supervisor was started. Under the lock, so a supervisor about to exit (nothing left to
        run) either sees the new spec or is gone before it is looked for."""
        with spec_lock(self.run_dir):
            running = self.pid() is not None
            old = self.spec()
            new = replace(change(old, running), revision=old.revision + 1)
            _write_json(self.run_dir / SPEC_FILE, asdict(new), mode=0o600)  # argv: a tuple, a JSON list
            started = not running and any(s.wanted for s in new.services)
            if started:
                self._spawn()
        return new, started

    def _spawn(self) -> None:
        self._proc = spawn(  # outlives `chatpipe up`; `down` or SIGTERM stops it
            [sys.executable, "-m", "chatpipe.cli", "supervise", "--state-dir", str(self.settings.state_dir.resolve())],
            self.log_file, header=f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} chatpipe supervise\n")

    def wait_applied(self, revision: int, timeout_s: float = 60.0) -> SupervisorState:
        """Wait until the supervisor has acted on spec ``revision`` (started or stopped what it says)."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state()
            if state is not None and state.spec_revision >= revision and (
                    state.pid == self.pid() or state.phase == "idle"):  # idle: it stopped its last service, exited
                return state
            proc = getattr(self, "_proc", None)
            if proc is not None and proc.poll() is not None:
                raise SupervisorError(f"the supervisor exited with code {proc.returncode} while starting. "
                                      f"Last lines of {self.log_file}:\n{tail(self.log_file)}")
            if time.monotonic() > deadline:
                raise SupervisorError(f"the supervisor did not act on the stack's services within {timeout_s:.0f} s "
                                      f"(pid {self.pid() or 'none'}). Last lines of {self.log_file}:\n"
                                      f"{tail(self.log_file)}")
            time.sleep(0.1)

    def wait_stopped(self, name: str, timeout_s: float) -> ServiceState | None:
        """Wait until the supervisor has ``name`` stopped (after a ``wanting(..., False)``)."""
        deadline = time.monotonic() + timeout_s
        while (state := self.state()) is not None and (record := state.services.get(name)) is not None:
            if record.state == "stopped":
                return record
            if time.monotonic() > deadline:
                raise SupervisorError(f"{name} did not stop within {timeout_s:.0f} s; see {self.log_file}")
            time.sleep(0.1)
        return None

    def release(self, timeout_s: float = 15.0) -> int | None:
        """Make the supervisor exit and leave the services running (SIGUSR1), so nothing is restarted
        while they are stopped one by one. Returns its pid (None if none ran)."""
        pid = self.pid()
        if pid is not None:
            terminate(pid, timeout_s, signal.SIGUSR1)  # SIGKILL after the timeout: it owns no data
            self.pid_file.unlink(missing_ok=True)
        return pid

    def forget(self) -> None:
        """Remove the spec and the state (after ``down``: the next ``up`` starts from nothing)."""
        with spec_lock(self.run_dir):
            for name in (SPEC_FILE, STATE_FILE):
                (self.run_dir / name).unlink(missing_ok=True)
