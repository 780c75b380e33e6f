"""Real Qdrant server processes for the memory tests: one node, or a peer of a cluster
(tests/streams/test_memory_cluster.py).

The server is ``../shared/tools/qdrant`` (v1.18.0 built from source; no registry here carries
one), found beside the repository. Where it is absent (a user's fresh clone) ``QDRANT_TOOL`` does
not exist and the fixtures skip, saying so. Every process gets free ports, its own storage folder,
telemetry off, and its own session (so a Ctrl-C of pytest does not reach it first); only processes
started here are ever signalled, by their own pid.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from chatpipe.testing.ports import free_port
from chatpipe.testing.processes import ServerProcess, REPO, http_ok, start_process, wait_until
from infra.services import tail

QDRANT_TOOL = REPO.parent / "shared" / "tools" / "qdrant"
SKIP_REASON = f"no Qdrant server at {QDRANT_TOOL}: the server and cluster memory tests need ../shared/tools/qdrant"


class QdrantPeer(ServerProcess):
    """One ``qdrant`` process on free ports; ``url`` is its REST address."""

    def __init__(self, root: Path, name: str, *, cluster: bool = False) -> None:
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.http_port, self.grpc_port, self.p2p_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.p2p_url = f"http://127.0.0.1:{self.p2p_port}"
        self.cluster = cluster
        self.proc: subprocess.Popen | None = None

    def start(self, *, bootstrap: "QdrantPeer | None" = None) -> None:
        env = dict(os.environ, QDRANT__SERVICE__HOST="127.0.0.1", QDRANT__SERVICE__HTTP_PORT=str(self.http_port),
                   QDRANT__SERVICE__GRPC_PORT=str(self.grpc_port), QDRANT__STORAGE__STORAGE_PATH=str(self.dir / "storage"),
                   QDRANT__STORAGE__SNAPSHOTS_PATH=str(self.dir / "snapshots"), QDRANT__TELEMETRY_DISABLED="true",
                   QDRANT__LOG_LEVEL="INFO")
        args = [str(QDRANT_TOOL)]
        if self.cluster:
            env.update(QDRANT__CLUSTER__ENABLED="true", QDRANT__CLUSTER__P2P__PORT=str(self.p2p_port))
            if bootstrap is not None:
                args += ["--bootstrap", bootstrap.p2p_url]
            args += ["--uri", self.p2p_url]
        # the tool script exec's the binary, so this pid is the server's own
        self.proc = start_process(args, log=self.dir / "qdrant.log", env=env, cwd=self.dir, new_session=True)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        wait_until(lambda: http_ok(f"{self.url}/readyz", timeout_s=1.0), timeout_s=timeout_s,
                   what=f"qdrant {self.dir.name}", proc=self.proc, log=self.log_tail)

    def log_tail(self, lines: int = 30) -> str:
        return tail(self.dir / "qdrant.log", lines)
