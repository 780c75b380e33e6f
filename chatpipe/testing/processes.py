"""Starting a service process and waiting for it, the way every stack harness here does it.

    start_process(argv, log=..., env=..., cwd=...)   output (stdout and stderr) appended to ``log``
    wait_until(check, timeout_s=..., what=..., proc=..., log=...)
                                                     poll until ready; fail early if the process
                                                     exited, or at the deadline, with its log's tail
    http_ok(url)                                     one GET answered 200 (no proxy)
    stop_process(proc, timeout_s)                    SIGTERM, wait, SIGKILL past the timeout
    StartedProcess(proc, log_path)                   a started process and its log (the harnesses' base)

A readiness failure raises :class:`NotReady` (an ``AssertionError``: in a test it reads as the test's
failure, with the service's own last lines).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from infra.services import tail

REPO = Path(__file__).resolve().parents[2]  # the clone the harness runs the services from
# The project's own interpreter: what the services run on, also when a bench runs in the vLLM environment
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
TAIL_CHARS = 3000  # of a log given as a function's text
TAIL_LINES = 40  # of a log file (infra.services.tail, what `chatpipe up` shows of a failed service)
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class StartedProcess:
    """A service process started here (:func:`start_process`), its output in ``log_path``."""

    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class NotReady(AssertionError):
    """A started service exited, or was not ready by its deadline; the message ends with its log's tail."""


def start_process(argv: Sequence[str], *, log: Path, env: Mapping[str, str] | None = None, cwd: Path | None = None,
                  new_session: bool = False, append: bool = True) -> subprocess.Popen:
    """``argv`` in the background, stdout and stderr appended to ``log`` (created with its folder;
    emptied first unless ``append``: a readiness check that reads the whole log must not see an
    earlier run's line)."""
    from infra.process_env import outside_env

    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    # from a re-executed bench (the vLLM environment, tcmalloc): not its preloads and threads
    env = outside_env(os.environ if env is None else env)
    with open(log, "ab" if append else "wb") as out:
        return subprocess.Popen([str(a) for a in argv], env=env, cwd=cwd,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=new_session)


def wait_until(check: Callable[[], object], *, timeout_s: float, what: str, proc: subprocess.Popen | None = None,
               log: Path | Callable[[], str] | None = None, interval_s: float = 0.2) -> object:
    """Call ``check`` until it returns something true (returned); ``what`` names the service/condition.

    Raises :class:`NotReady` as soon as ``proc`` has exited, or after ``timeout_s``, with the tail of
    ``log`` (a path, or a function giving the text to show)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise NotReady(f"{what}: exited with {proc.returncode}:\n{_tail(log)}")
        result = check()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise NotReady(f"{what}: not ready after {timeout_s:.0f}s:\n{_tail(log)}")
        time.sleep(interval_s)


def _tail(log: Path | Callable[[], str] | None) -> str:
    if callable(log):
        return log()[-TAIL_CHARS:]
    return "" if log is None else tail(Path(log), TAIL_LINES)


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when a GET of ``url`` is answered 200 (no proxy: the services listen on loopback)."""
    try:
        with _NO_PROXY.open(url, timeout=timeout_s) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def stop_process(proc: subprocess.Popen, timeout_s: float = 30.0, *, sig: int = signal.SIGTERM,
                 kill_after: bool = True) -> int | None:
    """Send ``sig`` (if it still runs) and wait up to ``timeout_s``; past it SIGKILL (``kill_after``) and
    re-raise ``subprocess.TimeoutExpired``. Returns the exit code."""
    if proc.poll() is None:
        os.kill(proc.pid, sig)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        if kill_after:
            proc.kill()
            proc.wait()
        raise


class ServerProcess:
    """``kill`` and ``stop`` of a server a test started itself (``self.proc``, its own session): the
    fixtures of real servers (``qdrant.py``, ``redis.py``) signal only the process they started."""

    proc: subprocess.Popen | None = None

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-request, as in a machine failure."""
        if self.proc is not None:
            stop_process(self.proc, 10, sig=signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM (a clean shutdown); SIGKILL past 15 s."""
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                stop_process(self.proc, 15)
