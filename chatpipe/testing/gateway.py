"""The whole pipeline for gateway tests: streams worker, inference worker and gateway processes.

Real processes, the same commands as production (``chatpipe streams | inference | gateway``),
on the session's broker under a topic prefix of their own. The inference worker runs the real
default model with a small KV budget so it fits a busy 2-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from chatpipe.testing.ports import free_port
from chatpipe.testing.processes import http_ok, start_process, stop_process, wait_until
from chatpipe.testing.streams import StreamsWorker
from chatpipe.testing.worker import CHATPIPE, REPO, WorkerProcess, start_worker
from transport.settings import KafkaSettings

API_KEY = "sk-test-" + uuid.uuid4().hex
OTHER_TENANT_KEY = "sk-test-other-" + uuid.uuid4().hex
# The model's context as both streams (assembly budget) and the worker (max_seq_len) see it.
CONTEXT_TOKENS = 1024


def write_keys(path: Path) -> Path:
    # API_KEY is multi-user: the tests name their own users (identified: memory across conversations)
    path.write_text(json.dumps({API_KEY: {"tenant": "acme", "users": "any"}, OTHER_TENANT_KEY: "globex"}))
    return path


@dataclass
class GatewayProcess:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout_s: float = 60) -> None:
        wait_until(lambda: http_ok(f"{self.url}/healthz"), timeout_s=timeout_s, what="gateway", proc=self.proc,
                   log=self.log_path)

    def terminate(self, timeout_s: float = 30) -> int:
        """SIGTERM and wait; past ``timeout_s`` SIGKILL and ``subprocess.TimeoutExpired``."""
        return stop_process(self.proc, timeout_s)


def start_gateway(kafka: KafkaSettings, root: Path, *, gateway_id: str | None = None, **env: str) -> GatewayProcess:
    port = free_port()
    gateway_id = gateway_id or f"gw-{uuid.uuid4().hex[:6]}"
    full_env = {**os.environ, "CHATPIPE_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
                "CHATPIPE_TOPIC_PREFIX": kafka.topic_prefix, "CHATPIPE_GATEWAY_PORT": str(port),
                "CHATPIPE_GATEWAY_KEYS_FILE": str(write_keys(root / "keys.json")),
                "CHATPIPE_GATEWAY_GATEWAY_ID": gateway_id, **env}
    log_path = root / f"{gateway_id}.log"
    proc = start_process([CHATPIPE, "gateway"], log=log_path, env=full_env, cwd=REPO, append=False)
    return GatewayProcess(proc, f"http://127.0.0.1:{port}", log_path)


@dataclass
class Pipeline:
    kafka: KafkaSettings
    streams: StreamsWorker
    worker: WorkerProcess
    gateway: GatewayProcess
    root: Path

    @property
    def traces_dir(self) -> Path:
        """Where the three processes write their spans (OTLP/JSON, transport/spans.py)."""
        return self.root / "traces"

    @property
    def url(self) -> str:
        return self.gateway.url

    def processes(self) -> dict[str, int]:
        return {"streams": self.streams.proc.pid, "inference": self.worker.proc.pid, "gateway": self.gateway.proc.pid}

    def stop(self) -> dict[str, int]:
        """SIGTERM to each, gateway first; their exit codes."""
        codes = {"gateway": self.gateway.terminate()}
        codes["inference"] = self.worker.terminate()
        codes["streams"] = self.streams.stop()
        return codes


def start_pipeline(kafka: KafkaSettings, root: Path) -> Pipeline:
    """Streams, one inference worker and one gateway, started together and waited for. Each writes
    its spans under ``root/traces`` (as ``chatpipe up`` has them write under the state folder), so
    every gateway test runs with tracing on."""
    from unittest import mock

    with mock.patch.dict(os.environ, {"CHATPIPE_TRACING_FILE_DIR": str(root / "traces")}):
        streams = StreamsWorker(kafka, root / "streams", context_tokens=CONTEXT_TOKENS, recent_turns=4)
        (root / "streams").mkdir(parents=True, exist_ok=True)
        worker = start_worker(kafka, root, worker_id="gw-test-worker", CHATPIPE_MAX_SEQ_LEN=str(CONTEXT_TOKENS),
                              CHATPIPE_KV_CACHE_TOKENS=str(8 * CONTEXT_TOKENS), CHATPIPE_MAX_BATCH="8")
        gateway = start_gateway(kafka, root)
    try:
        streams.start()
        worker.wait_serving(240)
        gateway.wait_healthy(120)
    except BaseException:
        for stop in (gateway.terminate, worker.terminate):
            try:
                stop()
            except Exception:  # noqa: BLE001 - already failing; clean up the rest
                pass
        if streams.proc is not None and streams.proc.poll() is None:
            streams.stop()
        raise
    return Pipeline(kafka, streams, worker, gateway, root)
