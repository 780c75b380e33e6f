"""The whole pipeline for gateway tests: streams worker, inference worker and gateway processes.

Real processes, the same commands as production (``chatpipe streams | inference | gateway``),
on the session's broker under a topic prefix of their own. The inference worker runs the real
default model with a small KV budget so it fits a busy 2-core machine.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from chatpipe.testing.ports import free_port
from chatpipe.testing.processes import StartedProcess, http_ok, start_process, stop_process, wait_until
from chatpipe.testing.streams import StreamsWorker
from chatpipe.testing.worker import CHATPIPE, REPO, WorkerProcess, start_worker
from transport.settings import KafkaSettings

API_KEY = "sk-test-" + uuid.uuid4().hex
OTHER_TENANT_KEY = "sk-test-other-" + uuid.uuid4().hex
# The model's context as both streams (assembly budget) and the worker (max_seq_len) see it.
CONTEXT_TOKENS = 1024


@dataclass
class GatewayProcess(StartedProcess):
    url: str

    def wait_healthy(self, timeout_s: float = 60) -> None:
        wait_until(lambda: http_ok(f"{self.url}/healthz"), timeout_s=timeout_s, what="gateway", proc=self.proc,
                   log=self.log_path)

    def terminate(self, timeout_s: float = 30) -> int:
        """SIGTERM and wait; past ``timeout_s`` SIGKILL and ``subprocess.TimeoutExpired``."""
        return stop_process(self.proc, timeout_s)


def start_gateway(kafka: KafkaSettings, root: Path, *, gateway_id: str | None = None, **env: str) -> GatewayProcess:
    port = free_port()
    gateway_id = gateway_id or f"gw-{uuid.uuid4().hex[:6]}"
    # API_KEY is multi-user: the tests name their own users (identified: memory across conversations)
    keys = root / "keys.json"
    keys.write_text(json.dumps({API_KEY: {"tenant": "acme", "users": "any"}, OTHER_TENANT_KEY: "globex"}))
    full_env = {**os.environ, "CHATPIPE_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
                "CHATPIPE_TOPIC_PREFIX": kafka.topic_prefix, "CHATPIPE_GATEWAY_PORT": str(port),
                "CHATPIPE_GATEWAY_KEYS_FILE": str(keys),
                "CHATPIPE_GATEWAY_GATEWAY_ID": gateway_id, **env}
    log_path = root / f"{gateway_id}.log"
    proc = start_process([CHATPIPE, "gateway"], log=log_path, env=full_env, cwd=REPO, append=False)
    return GatewayProcess(proc, log_path, f"http://127.0.0.1:{port}")


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

    def stop(self) -> dict[str, int]:
        """SIGTERM to each, gateway first; their exit codes."""
        codes = {"gateway": self.gateway.terminate()}
        codes["inference"] = self.worker.terminate()
        codes["streams"] = self.streams.stop()
        return codes

    def stop_all(self) -> None:
        """Stop each process that still runs, going on past a failure (printed): the clean-up after a
        failed start, or a benchmark's."""
        for stop in (self.gateway.terminate, self.worker.terminate):
            try:
                stop()
            except Exception as exc:  # noqa: BLE001 - report and go on stopping the rest
                print(f"  (stopping: {exc})")
        if self.streams.proc is not None and self.streams.proc.poll() is None:
            self.streams.stop()


def start_pipeline(kafka: KafkaSettings, root: Path, *, tracing: bool = True, worker_env: Mapping[str, str] = {},
                   gateway_env: Mapping[str, str] = {}, streams_env: Mapping[str, str] = {}) -> Pipeline:
    """Streams, one inference worker and one gateway, started together and waited for. Each writes
    its spans under ``root/traces`` (as ``chatpipe up`` has them write under the state folder), so
    every gateway test runs with tracing on; with ``tracing`` off none records any (bench/e2e.py).
    ``worker_env``, ``gateway_env`` and ``streams_env``: more CHATPIPE_* variables of those processes (the
    streams worker's response cache: ``CHATPIPE_CACHE_URL``)."""
    from unittest import mock

    with mock.patch.dict(os.environ, {"CHATPIPE_TRACING_FILE_DIR": str(root / "traces")}):
        if not tracing:
            os.environ.pop("CHATPIPE_TRACING_FILE_DIR")
            os.environ.pop("CHATPIPE_TRACING_OTLP_ENDPOINT", None)
        streams = StreamsWorker(kafka, root / "streams", env=streams_env, context_tokens=CONTEXT_TOKENS, recent_turns=4)
        (root / "streams").mkdir(parents=True, exist_ok=True)
        worker = start_worker(kafka, root, worker_id="gw-test-worker", **{
            "CHATPIPE_MAX_SEQ_LEN": str(CONTEXT_TOKENS), "CHATPIPE_KV_CACHE_TOKENS": str(8 * CONTEXT_TOKENS),
            "CHATPIPE_MAX_BATCH": "8", **worker_env})
        gateway = start_gateway(kafka, root, **gateway_env)
    pipeline = Pipeline(kafka, streams, worker, gateway, root)
    try:
        streams.start()
        worker.wait_serving(300)
        gateway.wait_healthy(120)
    except BaseException:
        pipeline.stop_all()
        raise
    return pipeline
