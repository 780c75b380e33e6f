"""The stack's supervisor (``chatpipe supervise``, started by ``chatpipe up``): it owns the services'
processes and starts again any that exits, whatever the exit (a code, a signal, a SIGKILL from
anyone), after a backoff delay (``infra.supervision.Backoff``). Locally it does what Kubernetes'
``restartPolicy: Always`` does in a deployment.

One loop, every 0.2 s, no threads: re-read the spec when its revision changed, reap the children
that exited (recording the reason, when, how long it ran and the last lines of its log), and bring
each service to what the spec asks: started, stopped (``wanted`` false: SIGTERM, SIGKILL after the
stop timeout) or restarted (a new ``generation``). It writes ``supervisor.json`` on every change.

Signals: SIGTERM / SIGINT stop every service in reverse order (SIGTERM, SIGKILL after
``stop_timeout_s``), then the supervisor exits; SIGUSR1 makes it exit at once and leave the
services running (``chatpipe down`` then stops them one by one and reports each). It also exits
once the spec wants nothing and nothing runs (after ``chatpipe stop`` of its last service).

Services are names in the spec and nothing more: ``streams-2`` (a second streams worker) is started,
reaped, backed off and recorded like ``streams``.

A service found running when the supervisor starts (a supervisor before it was killed) is adopted:
watched through its pid, restarted when it goes, but its exit status cannot be known (not our child).

Not here: what the services run (``infra.stack``), the file formats (``infra.supervision``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from infra import supervision as sv
from infra.services import alive, pid_in, read_pid_file, spawn, start_time, tail, write_pid_file
from infra.settings import StackSettings

TICK_S = 0.2
log = logging.getLogger("chatpipe.supervisor")


@dataclass
class _Child:
    """One service as the supervisor runs it."""

    record: sv.ServiceState
    backoff: sv.Backoff
    proc: subprocess.Popen | None = None
    adopted_token: str | None = None  # /proc start time of an adopted (not our child) process
    started_mono: float = 0.0
    next_start_mono: float | None = None
    stop_deadline: float | None = None
    killed: bool = False
    crashed: sv.ExitRecord | None = None  # the unasked exit that the next start follows (a restart)

    @property
    def running(self) -> bool:
        return self.record.state in ("running", "stopping")


class Supervisor:
    def __init__(self, settings: StackSettings) -> None:
        self.settings = settings
        self.run_dir = settings.run_dir
        self.spec = sv.Spec(revision=-1)
        self.children: dict[str, _Child] = {}
        self.state = sv.SupervisorState(pid=os.getpid(), started_at=time.time())
        self._shutdown = False
        self._release = False
        self._spec_key: tuple[int, int] | None = None  # (inode, mtime) of the spec file last read

    # --- the process ---------------------------------------------------------------------------
    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        pid_file = self.run_dir / sv.PID_FILE
        lock = open(self.run_dir / sv.RUNNING_FILE, "a")  # held while this supervisor lives
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another supervisor runs for %s; exiting", self.settings.state_dir)
            return 0
        signal.signal(signal.SIGTERM, self._on_shutdown)
        signal.signal(signal.SIGINT, self._on_shutdown)
        signal.signal(signal.SIGUSR1, self._on_release)
        write_pid_file(pid_file, os.getpid())
        log.info("supervising the stack in %s (pid %d)", self.settings.state_dir, os.getpid())
        try:
            while True:
                if self._release:
                    self._set_phase("released")
                    log.info("released: the services keep running unsupervised")
                    return 0
                if self._shutdown:
                    self._stop_all()
                    self._set_phase("stopped")
                    log.info("every service stopped; exiting")
                    return 0
                try:
                    self._tick()
                    if self._idle_exit():
                        return 0
                except OSError as exc:  # e.g. a full disk under the state folder: keep supervising
                    log.error("supervisor tick failed (%s); retrying", exc)
                time.sleep(TICK_S)
        finally:
            if pid_in(pid_file) == os.getpid():
                pid_file.unlink(missing_ok=True)

    def _on_shutdown(self, signum, frame) -> None:
        self._shutdown = True

    def _on_release(self, signum, frame) -> None:
        self._release = True

    def _set_phase(self, phase: str) -> None:
        self.state.phase = phase
        sv.write_state(self.run_dir, self.state)

    # --- one pass ------------------------------------------------------------------------------
    def _tick(self) -> None:
        changed = self._reload_spec()
        for child in self.children.values():
            changed |= self._reap(child)
        for service in self.spec.services:
            changed |= self._reconcile(service, self._child(service.name))
        for name, child in self.children.items():
            if self.spec.get(name) is None:
                changed |= self._reconcile(None, child)
        if changed:
            sv.write_state(self.run_dir, self.state)

    def _reload_spec(self) -> bool:
        try:  # the spec is replaced, never rewritten in place: a new file is a new inode
            seen = (self.run_dir / sv.SPEC_FILE).stat()
            key: tuple[int, int] | None = (seen.st_ino, seen.st_mtime_ns)
        except FileNotFoundError:
            key = None
        if key == self._spec_key and key is not None:
            return False
        self._spec_key = key
        try:
            spec = sv.read_spec(self.run_dir)
        except sv.SupervisorError as exc:
            log.error("%s", exc)  # keep the last good spec
            return False
        if spec.revision == self.spec.revision:
            return False
        self.spec = spec
        self.state.spec_revision = spec.revision
        return True

    def _child(self, name: str) -> _Child:
        if name not in self.children:
            s = self.settings
            record = sv.ServiceState(name)
            self.children[name] = _Child(record, sv.Backoff(s.restart_backoff_s, s.restart_backoff_max_s,
                                                            s.restart_backoff_reset_s))
            self.state.services[name] = record
            service = self.spec.get(name)
            if service is not None and service.wanted:
                self._adopt(service, self.children[name])
        return self.children[name]

    def _adopt(self, service: sv.ServiceSpec, child: _Child) -> None:
        """Take over a service that a supervisor before this one started and that still runs."""
        pid = read_pid_file(Path(service.pid_file))  # None unless that very process (pid + start time) runs
        token = start_time(pid) if pid is not None else None
        if token is None:
            return
        child.adopted_token, child.started_mono = token, time.monotonic()
        r = child.record
        r.state, r.pid, r.started_at, r.adopted, r.generation = "running", pid, time.time(), True, service.generation
        log.info("%s: adopted pid %d (already running)", service.name, pid)

    # --- exits ---------------------------------------------------------------------------------
    def _reap(self, child: _Child) -> bool:
        if not child.running:
            return False
        r = child.record
        if child.proc is not None:
            code = child.proc.poll()
            if code is None:
                return self._escalate(child)
            reason, exit_code, sig = sv.exit_reason(code)
        else:  # adopted: not our child, so only its going away can be seen
            if r.pid is not None and alive(r.pid) and start_time(r.pid) == child.adopted_token:
                return self._escalate(child)
            reason, exit_code, sig = "exited (status unknown: adopted, not started by this supervisor)", None, None
        self._record_exit(child, reason, exit_code, sig)
        return True

    def _escalate(self, child: _Child) -> bool:
        """SIGKILL a service that outlived its stop timeout after SIGTERM."""
        if child.stop_deadline is None or child.killed or time.monotonic() < child.stop_deadline:
            return False
        log.warning("%s: pid %s still runs %.0f s after SIGTERM: SIGKILL", child.record.name, child.record.pid,
                    self.settings.stop_timeout_s)
        self._signal(child, signal.SIGKILL)
        child.killed = True
        return False

    def _record_exit(self, child: _Child, reason: str, code: int | None, sig: str | None) -> None:
        r = child.record
        service = self.spec.get(r.name)
        requested = r.state == "stopping"
        ran_s = time.monotonic() - child.started_mono
        log_path = service.tail_file or service.log_file if service else None
        lines = tail(Path(log_path), sv.LOG_LINES_KEPT).splitlines() if log_path else []
        exit_ = sv.ExitRecord(time.time(), reason, code, sig, round(ran_s, 3), requested, lines)
        r.exits = [*r.exits, exit_][-sv.EXITS_KEPT:]
        if service is not None and pid_in(Path(service.pid_file)) == r.pid:
            Path(service.pid_file).unlink(missing_ok=True)
        r.pid, r.started_at, r.adopted = None, None, False
        child.proc, child.adopted_token, child.stop_deadline, child.killed = None, None, None, False
        if requested:
            r.state = "stopped"
            log.info("%s: stopped (%s) after %.1f s", r.name, reason, ran_s)
            return
        delay = child.backoff.next_delay(ran_s)
        exit_.delay_s = delay
        r.state, r.next_start_at = "backoff", time.time() + delay
        child.next_start_mono, child.crashed = time.monotonic() + delay, exit_
        log.warning("%s: %s after %.1f s; restart %d in %.1f s", r.name, reason, ran_s, r.restarts + 1, delay)

    # --- bringing a service to what the spec asks ----------------------------------------------
    def _reconcile(self, service: sv.ServiceSpec | None, child: _Child) -> bool:
        r = child.record
        if service is None or not service.wanted:
            if r.state == "running":
                return self._begin_stop(child, "stop requested")
            if r.state == "backoff":
                r.state, r.next_start_at, child.crashed = "stopped", None, None
                return True
            return False
        if service.generation != r.generation:  # `chatpipe restart`
            if r.state == "running":
                return self._begin_stop(child, "restart requested")
            if r.state == "stopping":
                return False
            r.generation = service.generation
            child.backoff.failures = 0
            child.crashed = None
            return self._start(service, child)
        if r.state == "stopped":
            return self._start(service, child)
        if r.state == "backoff" and time.monotonic() >= (child.next_start_mono or 0):
            return self._start(service, child)
        return False

    def _begin_stop(self, child: _Child, why: str) -> bool:
        log.info("%s: %s: SIGTERM to pid %s", child.record.name, why, child.record.pid)
        child.record.state = "stopping"
        child.stop_deadline = time.monotonic() + self.settings.stop_timeout_s
        self._signal(child, signal.SIGTERM)
        return True

    def _signal(self, child: _Child, sig: signal.Signals) -> None:
        with suppress(ProcessLookupError):  # gone already: the next reap records it
            if child.proc is not None:
                child.proc.send_signal(sig)
            elif child.record.pid is not None:
                os.kill(child.record.pid, sig)

    def _start(self, service: sv.ServiceSpec, child: _Child) -> bool:
        r = child.record
        after = child.crashed
        what = f"restart {r.restarts + 1} after {after.reason}" if after else "start"
        if after is not None:  # a start that fails counts too: it is a restart that ended at once
            r.restarts += 1
            after.restart_at = time.time()
        try:
            proc = spawn(list(service.argv), service.log_file, cwd=service.cwd, env=service.env,
                         header=f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {what} (supervisor pid {os.getpid()}): "
                                f"{_shown(service.argv)}\n")
        except OSError as exc:
            log.error("%s: could not start: %s", r.name, exc)
            child.started_mono = time.monotonic()
            r.state = "running"  # so that the exit below is a failure with backoff, like any other
            self._record_exit(child, f"could not start: {exc}", None, None)
            return True
        write_pid_file(Path(service.pid_file), proc.pid)
        child.proc, child.started_mono, child.crashed = proc, time.monotonic(), None
        r.state, r.pid, r.started_at, r.next_start_at = "running", proc.pid, time.time(), None
        r.generation = service.generation
        log.info("%s: %s: pid %d", r.name, what, proc.pid)
        return True

    # --- the end -------------------------------------------------------------------------------
    def _stop_all(self) -> None:
        """SIGTERM to each service in reverse start order, one at a time; SIGKILL after the stop timeout."""
        self._set_phase("shutting down")
        log.info("SIGTERM: stopping every service")
        order = [s.name for s in self.spec.services] + [n for n in self.children if self.spec.get(n) is None]
        for name in reversed(order):
            child = self.children.get(name)
            if child is None:
                continue
            if child.record.state == "backoff":
                child.record.state, child.record.next_start_at = "stopped", None
            if child.record.state == "running":
                self._begin_stop(child, "shutting down")
            give_up = time.monotonic() + self.settings.stop_timeout_s + 10  # SIGKILL comes at stop_timeout_s
            while child.running and time.monotonic() < give_up:
                self._reap(child)
                time.sleep(0.05)
            if child.running:
                log.error("%s: pid %s did not exit even after SIGKILL", name, child.record.pid)
            sv.write_state(self.run_dir, self.state)

    def _idle_exit(self) -> bool:
        """Exit when the spec wants nothing and nothing runs; decided under the spec lock, so a command
        that writes a new spec meanwhile sees this supervisor gone and starts another."""
        if any(s.wanted for s in self.spec.services) or any(c.record.state != "stopped" for c in self.children.values()):
            return False
        with sv.spec_lock(self.run_dir):
            if any(s.wanted for s in sv.read_spec(self.run_dir).services):
                return False
            self._set_phase("idle")
            (self.run_dir / sv.PID_FILE).unlink(missing_ok=True)
        log.info("nothing left to supervise: exiting")
        return True


def _shown(argv: tuple[str, ...]) -> str:
    if len(argv) > 2 and argv[0] == sys.executable and argv[1:3] == ("-m", "chatpipe.cli"):
        return "chatpipe " + shlex.join(argv[3:])
    return shlex.join(argv)


def main(settings: StackSettings) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(levelname)s %(message)s")
    return Supervisor(settings).run()
