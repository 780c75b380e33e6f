"""The whole stack for the fault tests: ``chatpipe up`` in a temporary state folder, with memory in a
real Qdrant server (``../shared/tools/qdrant``) and the archive on a small tmpfs of its own.

Everything is a real process started the way a user starts it; the only thing the tests do to it
is what a failing machine would: SIGKILL a process, stop a server for a while, fill a disk, restart
the broker. ``chatpipe up``'s supervisor restarts what exits (docs/stack.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from chatpipe.testing.ports import free_port
from chatpipe.testing.processes import wait_until
from chatpipe.testing.qdrant import QdrantPeer
from infra.services import alive
from tests.faults.poison import CRASH_DRILL_TEXT

SERVICES = ("kafka", "redis", "streams", "inference", "gateway")
ARCHIVE_TMPFS_SIZE = "24m"

# Small enough for the broker, Qdrant, streams (two models), one worker and the gateway on 2 cores.
SERVICE_ENV = {
    "CHATPIPE_MAX_BATCH": "8", "CHATPIPE_KV_CACHE_TOKENS": "8192", "CHATPIPE_MAX_SEQ_LEN": "1024",
    "CHATPIPE_DEVICE": "cpu", "CHATPIPE_STREAMS_CONTEXT_TOKENS": "1024",
    # A client's answer waits at most this long (the gateway's 504, and the deadline it puts on
    # each PromptRequest): long enough to ride out every fault below.
    "CHATPIPE_GATEWAY_FIRST_CHUNK_TIMEOUT_S": "150",
    # The reply reader's budget before the gateway exits to be restarted (its topic deleted): shorter
    # than the default 60 s so the scenario does not wait a minute; longer than a broker restart.
    "CHATPIPE_GATEWAY_REPLY_ERROR_BUDGET_S": "20",
    # The worker's fault drill: a request with this last message makes it raise RuntimeError (poison.py).
    "CHATPIPE_WORKER_DRILL_CRASH_ON": CRASH_DRILL_TEXT,
}


def cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "COLUMNS": "220", **(env or {})}
    return subprocess.run([sys.executable, "-m", "chatpipe.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


class FaultStack:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.state = root / "state"
        self.archive = self.state / "archive"
        self.qdrant = QdrantPeer(root, "qdrant")
        self.gateway_port = free_port()
        self.kafka_port = free_port()
        self.flags = ["--state-dir", str(self.state), "--kafka-port", str(self.kafka_port),
                      "--controller-port", str(free_port()), "--gateway-port", str(self.gateway_port),
                      "--worker-metrics-port", str(free_port()), "--streams-metrics-port", str(free_port()),
                      "--redis-port", str(free_port())]
        self._mounted = False

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.kafka_port}"

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def api_key(self) -> str:
        return next(iter(json.loads((self.state / "gateway" / "keys.json").read_text())))

    # -- lifecycle ---------------------------------------------------------------------------------

    def up(self) -> None:
        self.qdrant.start()
        self.qdrant.wait_ready()
        self.archive.mkdir(parents=True)
        # A real small filesystem, so "disk full" is the kernel's ENOSPC, not a simulation. Needs
        # CAP_SYS_ADMIN (root here and in CI); the error says so where it is missing.
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={ARCHIVE_TMPFS_SIZE}", "tmpfs", str(self.archive)],
                               capture_output=True, text=True)
        if mount.returncode != 0:
            raise RuntimeError(f"the fault tests mount a tmpfs for the archive and could not: {mount.stderr.strip()} "
                               "(run them as root, as CI does)")
        self._mounted = True
        up = cli("up", *self.flags, "--qdrant-url", self.qdrant.url, timeout=900, env=SERVICE_ENV)
        if up.returncode != 0:
            raise RuntimeError(f"chatpipe up failed:\n{up.stdout}\n{up.stderr}")

    def down(self) -> subprocess.CompletedProcess:
        result = cli("down", "--state-dir", str(self.state), timeout=300)
        self.qdrant.stop()
        if self._mounted:
            subprocess.run(["umount", "-l", str(self.archive)], capture_output=True)
            self._mounted = False
        return result

    # -- what a test looks at ----------------------------------------------------------------------

    def pid(self, service: str) -> int | None:
        path = self.state / "kafka" / "broker.pid" if service == "kafka" else self.state / "run" / f"{service}.pid"
        try:
            pid = int(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if alive(pid) else None

    def status(self) -> subprocess.CompletedProcess:
        return cli("status", "--state-dir", str(self.state), timeout=120)

    def restarts(self) -> dict[str, int]:
        """Restarts per service so far, as the supervisor recorded them (``chatpipe status --json``)."""
        result = cli("status", "--state-dir", str(self.state), "--json", timeout=120)
        data = json.loads(result.stdout)
        return {s["name"]: int(s.get("restarts") or 0) for s in data["services"]}

    def wait_healthy(self, timeout_s: float = 300) -> None:
        """Until ``chatpipe status`` exits 0; the failure shows its last output."""
        last: list[subprocess.CompletedProcess] = []

        def healthy() -> bool:
            last[:] = [self.status()]
            return last[0].returncode == 0

        wait_until(healthy, timeout_s=timeout_s, what="stack (chatpipe status)", interval_s=2,
                   log=lambda: f"{last[0].stdout}\n{last[0].stderr}" if last else "")

    def log_offset(self, service: str) -> int:
        path = self.state / "logs" / f"{service}.log"
        return path.stat().st_size if path.exists() else 0

    def log_since(self, service: str, offset: int) -> str:
        """What ``service`` logged after ``offset`` (its log survives restarts: the supervisor appends)."""
        with open(self.state / "logs" / f"{service}.log", "rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")

    # -- faults ------------------------------------------------------------------------------------

    def kill(self, service: str, sig: int = signal.SIGKILL) -> int:
        pid = self.pid(service)
        assert pid is not None, f"{service} is not running"
        os.kill(pid, sig)
        return pid

    def wait_restarted(self, service: str, old_pid: int, timeout_s: float = 300) -> int:
        def restarted() -> int | None:
            pid = self.pid(service)
            return pid if pid is not None and pid != old_pid else None

        return wait_until(restarted, timeout_s=timeout_s, what=f"{service} restarted by the supervisor",
                          interval_s=0.5, log=self.state / "logs" / f"{service}.log")

    def fill_archive_disk(self) -> Path:
        """Fill the archive's tmpfs to the last byte (the archiver's next write gets ENOSPC)."""
        filler = self.archive / ".filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M", "status=none"], capture_output=True)
        return filler
