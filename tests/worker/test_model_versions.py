"""The worker follows ``chat.models`` (issue 42, point 2): it serves the CANARY and LIVE versions of its
base model, says which in its heartbeats, names the exact version on each Response, marks a corrupt
artifact FAILED with the reason and goes on serving the rest, and stops serving a retired version.

A real broker and a real worker process (SmolLM2); the adapters are peft's (random factors, the shape
``chatpipe train lora`` makes), in an artifact store folder laid out as training publishes
(``<store>/<name>/<version>/adapter``).
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import httpx
import pytest

from chatpipe.testing.lora_adapters import make_adapter
from chatpipe.testing.ports import free_port
from chatpipe.testing.worker import make_request, send_requests, start_worker
from inference.engine.settings import DEFAULT_MODEL_NAME
from schemas.models import ADAPTER_DIR, ADAPTER_WEIGHTS
from schemas.records import ModelState, ModelVersion, now_ms
from transport.artifacts import sha256_files
from transport.model_registry import publish_model_version, read_model_versions

pytestmark = [pytest.mark.integration, pytest.mark.model]

QUESTION = "What is the capital of France? Answer in one sentence."


def version_record(store, name: str, number: int, state: ModelState, sha256: str | None = None) -> ModelVersion:
    folder = store / name / str(number)
    adapter = folder / ADAPTER_DIR
    return ModelVersion(
        name=name, version=number, base_model=DEFAULT_MODEL_NAME, base_model_sha256="0" * 64,
        adapter_uri=str(adapter), adapter_sha256=sha256 or sha256_files([adapter / ADAPTER_WEIGHTS]),
        card_uri=str(folder), lineage_uri=str(folder / "lineage.parquet"), dataset_uri="/datasets/none",
        dataset_manifest_id="0" * 64, tenant="acme", data_tenants=["acme"], training_rows=1, state=state,
    )  # fmt: skip


def ask(worker_kafka, reader, i: int, model: str):
    req = replace(make_request(i, text=QUESTION, max_tokens=12, tenant="acme"), model=model)
    send_requests(worker_kafka, [req])
    reader.wait_responses([req.request_id], 180)
    return reader.seen.first_response(req.request_id)[0]


def latest_status(seen, worker_id: str):
    return [s for s in seen.statuses if s.worker_id == worker_id][-1]


def test_worker_serves_live_versions_fails_a_corrupt_one_and_drops_a_retired_one(worker_kafka, reader, tmp_path):
    from inference.engine.model_store import load_model
    from inference.engine.settings import EngineSettings

    model, _ = load_model(EngineSettings(device="cpu", dtype="float32"))  # the worker's base: the adapter's shapes
    store = tmp_path / "store"
    make_adapter(model, store / "acme-lora" / "1" / ADAPTER_DIR, seed=21, r=16, alpha=32, b_scale=1.0)
    v1 = version_record(store, "acme-lora", 1, ModelState.LIVE)
    publish_model_version(worker_kafka, v1)  # before the worker starts: its initial read finds it
    port = free_port()
    worker = start_worker(worker_kafka, tmp_path, CHATPIPE_WORKER_ADAPTER_CACHE=str(tmp_path / "cache"),
                          CHATPIPE_WORKER_METRICS_PORT=str(port))
    try:
        worker.wait_serving()
        reader.wait_for(lambda s: any(st.worker_id == worker.worker_id and st.model_versions == ["acme-lora@1"]
                                      for st in s.statuses), 30, "a heartbeat naming acme-lora@1")
        ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=10)  # a pod's readiness: it holds its versions
        assert ready.status_code == 200 and "acme-lora@1" in ready.text, ready.text
        assert "chatpipe_" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text

        base = ask(worker_kafka, reader, 1, DEFAULT_MODEL_NAME)
        tuned = ask(worker_kafka, reader, 2, "acme-lora@1")
        assert base.error is None and tuned.error is None, (base.error, tuned.error)
        assert (base.model, tuned.model) == (DEFAULT_MODEL_NAME, "acme-lora@1")  # the exact version that answered
        assert tuned.text != base.text  # the adapter ran

        # Version 2's weights in the store are not the ones its record hashed: FAILED, with the reason.
        shutil.copytree(store / "acme-lora" / "1", store / "acme-lora" / "2")
        weights = store / "acme-lora" / "2" / ADAPTER_DIR / ADAPTER_WEIGHTS
        v2 = version_record(store, "acme-lora", 2, ModelState.CANARY)
        weights.write_bytes(weights.read_bytes()[:-64] + bytes(64))  # corrupted after training hashed it
        publish_model_version(worker_kafka, v2)
        failed = wait_for_state(worker_kafka, "acme-lora@2", ModelState.FAILED)
        assert failed.state_reason.startswith("worker: ArtifactError") and "sha256" in failed.state_reason
        assert "acme-lora@2 cannot be served" in worker.log()
        refused = ask(worker_kafka, reader, 3, "acme-lora@2")
        assert refused.error is not None and "ModelVersionError" in refused.error
        reader.wait_for(lambda s: any(d.error_type == "ModelVersionError" for d in s.dead_letters), 30,
                        "the request's dead letter")
        again = ask(worker_kafka, reader, 4, "acme-lora@1")  # the others are served as before
        assert again.error is None and again.text == tuned.text

        publish_model_version(worker_kafka, replace(v1, state=ModelState.RETIRED, updated_at=now_ms()))
        reader.wait_for(lambda s: latest_status(s, worker.worker_id).model_versions == [], 30,
                        "a heartbeat without acme-lora@1")
        retired = ask(worker_kafka, reader, 5, "acme-lora@1")
        assert "is RETIRED on chat.models" in retired.error
        assert ask(worker_kafka, reader, 6, DEFAULT_MODEL_NAME).text == base.text
    finally:
        worker.terminate()


def wait_for_state(kafka, ref: str, state: ModelState, timeout_s: float = 60.0) -> ModelVersion:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        version = read_model_versions(kafka).get(ref)
        if version is not None and version.state is state:
            return version
        time.sleep(0.5)
    raise AssertionError(f"{ref} did not become {state.value} within {timeout_s} s (now: {version})")
