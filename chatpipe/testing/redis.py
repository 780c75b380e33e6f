"""A real Redis server for the response cache's tests: the stack's own command line (``infra.redis_server``),
on a free port, in a folder of the test's own.

``RedisServer(root, maxmemory="64mb")`` is not started until ``start()`` (or ``with``); ``url`` is fixed
from the start (the port is chosen in ``__init__`` and kept), so a test can hand it to a streams worker,
``kill()`` the server (SIGKILL: it vanishes mid-request, its cache with it: no persistence) and
``start()`` it again on the same port ("Redis killed -> requests still answered, Redis back -> used
again"). ``stop()`` is SIGTERM (Redis shuts down cleanly). The process has its own session, so a Ctrl-C
of pytest does not reach it first; only a process started here is ever signalled, by its own pid.

The server is ``redis-server`` on PATH (Debian's package; ``make prerequisites`` installs it), or
``CHATPIPE_REDIS_SERVER``; where it is missing, ``start()`` fails with the one line that says what to install.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from chatpipe.testing.ports import free_port
from chatpipe.testing.processes import ServerProcess, start_process, wait_until
from infra import redis_server
from infra.services import tail
from infra.settings import StackSettings

HOST = "127.0.0.1"


class RedisServer(ServerProcess):
    """One ``redis-server`` on a free loopback port: ``url``, ``start()``, ``stop()``, ``kill()``."""

    def __init__(self, root: Path, *, maxmemory: str = "64mb", policy: str = "allkeys-lru", name: str = "redis") -> None:
        self.root = Path(root) / name
        self.port = free_port()
        # The stack's settings with this server's port and limits: its command line is the stack's.
        self.settings = StackSettings(state_dir=self.root, host=HOST, redis_port=self.port, redis_maxmemory=maxmemory,
                                      redis_maxmemory_policy=policy)
        self.dir = redis_server.folder(self.settings)  # <root>/<name>/redis: the server's working folder
        self.log_file = self.root / "redis.log"
        self.url = redis_server.url(self.settings)
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.running() else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 30.0) -> "RedisServer":
        """Start the server (again, on the same port) and wait until it answers PING; a no-op while it runs."""
        if self.running():
            return self
        argv, cwd = redis_server.command(self.settings, redis_server.executable(self.settings))
        cwd.mkdir(parents=True, exist_ok=True)
        self.proc = start_process(argv, log=self.log_file, cwd=cwd, new_session=True)
        wait_until(self.answers, timeout_s=timeout_s, what=f"redis-server on :{self.port}", proc=self.proc,
                   log=self.log_file)
        return self

    def answers(self) -> bool:
        """True when a PING is answered +PONG."""
        return self.ping() == "+PONG"

    def ping(self) -> str:
        """The server's answer to a PING ("" when nothing answers)."""
        return redis_server.ping(HOST, self.port)

    def log_tail(self, lines: int = 30) -> str:
        return tail(self.log_file, lines)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
