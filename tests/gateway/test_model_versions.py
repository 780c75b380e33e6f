"""Choosing the model version through the whole pipeline (issue 42, points 3 and 4): ``/v1/models`` lists
a tenant's served versions and aliases; an explicit version is honoured for its tenant and refused (403)
for another; a plain name goes to the tenant's LIVE version, or to a CANARY for its share of new
conversations; a conversation keeps its version (ledger: the Responses on ``chat.responses``) until that
version leaves service; every Response and turn names the exact version.

The package's pipeline (real broker, streams, worker, gateway); the versions' adapters are peft's (random
factors) in an artifact store folder, published on ``chat.models`` as training publishes them. The test
retires its versions at the end: the pipeline's other tests ask the base model for tenant acme.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import httpx
import pytest

from chatpipe.testing.gateway import API_KEY, OTHER_TENANT_KEY
from chatpipe.testing.lora_adapters import make_adapter
from chatpipe.testing.streams import Tap
from inference.engine.settings import DEFAULT_MODEL_NAME
from schemas.models import ADAPTER_DIR, ADAPTER_WEIGHTS
from schemas.records import ModelState, ModelVersion, now_ms
from schemas.topics import RESPONSES, TURNS
from transport.artifacts import sha256_files
from transport.model_registry import promote, publish_model_version, read_model_versions

pytestmark = [pytest.mark.integration, pytest.mark.model]
CONVERSATIONS = [f"rollout-{i}" for i in range(10)]


def publish(kafka, store, name: str, number: int, state: ModelState, tenant: str, share: float = 0.0,
            seed: int = 0, base=None) -> ModelVersion:  # fmt: skip
    folder = store / name / str(number)
    if base is not None:
        make_adapter(base, folder / ADAPTER_DIR, seed=seed, r=8, alpha=16, b_scale=1.0)
    version = ModelVersion(
        name=name, version=number, base_model=DEFAULT_MODEL_NAME, base_model_sha256="0" * 64,
        adapter_uri=str(folder / ADAPTER_DIR), adapter_sha256=sha256_files([folder / ADAPTER_DIR / ADAPTER_WEIGHTS]),
        card_uri=str(folder), lineage_uri=str(folder / "lineage.parquet"), dataset_uri="/d", dataset_manifest_id="0",
        tenant=tenant, data_tenants=[tenant], training_rows=1, state=state, canary_share=share,
    )  # fmt: skip
    publish_model_version(kafka, version)
    return version


def chat(pipeline, conversation: str, text: str, model: str = DEFAULT_MODEL_NAME, key: str = API_KEY):
    return httpx.post(f"{pipeline.url}/v1/chat/completions", timeout=300,
                      headers={"Authorization": f"Bearer {key}", "X-Chatpipe-Conversation-Id": conversation},
                      json={"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8,
                            "temperature": 0})


def answered_by(tap: Tap, conversations: set[str], want: int) -> dict[str, list[str]]:
    """conversation -> the models of its Responses, in order (the ledger)."""
    messages = tap.messages(want, 120, where=lambda m: tap.codec.decode(m.value()).conversation_id in conversations)
    ledger = defaultdict(list)
    for m in messages:
        response = tap.codec.decode(m.value())
        ledger[response.conversation_id].append(response.model)
    return ledger


def test_versions_are_listed_chosen_per_conversation_and_kept_until_retired(pipeline, tmp_path):
    from inference.engine.model_store import load_model
    from inference.engine.settings import EngineSettings

    kafka = pipeline.kafka
    base, _ = load_model(EngineSettings(device="cpu", dtype="float32"))
    store = tmp_path / "store"
    v1 = publish(kafka, store, "acme-lora", 1, ModelState.LIVE, "acme", seed=31, base=base)
    v2 = publish(kafka, store, "acme-lora", 2, ModelState.CANARY, "acme", share=0.5, seed=32, base=base)
    other = publish(kafka, store, "globex-lora", 1, ModelState.LIVE, "globex", seed=33, base=base)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    tap = Tap(kafka, RESPONSES)
    try:
        listed = httpx.get(f"{pipeline.url}/v1/models", headers=auth, timeout=30).json()["data"]
        ids = [m["id"] for m in listed]
        assert ids == [DEFAULT_MODEL_NAME, "acme-lora@1", "acme-lora@2", "acme-lora"], ids
        assert listed[2]["state"] == "CANARY" and listed[2]["canary_share"] == 0.5
        assert listed[3]["alias_of"] == "acme-lora@1"
        other_listed = httpx.get(f"{pipeline.url}/v1/models", headers={"Authorization": f"Bearer {OTHER_TENANT_KEY}"},
                                 timeout=30).json()["data"]
        assert [m["id"] for m in other_listed] == [DEFAULT_MODEL_NAME, "globex-lora@1", "globex-lora"]

        forbidden = chat(pipeline, "x-1", "Hi", model="globex-lora@1")
        assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "model_forbidden"
        missing = chat(pipeline, "x-2", "Hi", model="acme-lora@9")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

        explicit = chat(pipeline, "explicit-1", "Say hello.", model="acme-lora@2")
        assert explicit.status_code == 200, explicit.text
        assert answered_by(tap, {"explicit-1"}, 1) == {"explicit-1": ["acme-lora@2"]}

        for turn in ("Name a colour.", "Name another one."):
            for conversation in CONVERSATIONS:
                response = chat(pipeline, conversation, turn)
                assert response.status_code == 200, response.text
        ledger = answered_by(tap, set(CONVERSATIONS), 2 * len(CONVERSATIONS))
        assert all(len(set(models)) == 1 for models in ledger.values()), ledger  # never two versions in a thread
        chosen = {c: models[0] for c, models in ledger.items()}
        assert set(chosen.values()) == {"acme-lora@1", "acme-lora@2"}, chosen  # the canary took its share

        # v2 promoted, v1 retired: v1's conversations move to v2 (their version left service), v2's stay.
        for record in promote(read_model_versions(kafka), "acme-lora@2", "better"):
            publish_model_version(kafka, record)
        wait_listed(pipeline, auth, lambda ids: "acme-lora@1" not in ids)
        for conversation in CONVERSATIONS:
            assert chat(pipeline, conversation, "And a third?").status_code == 200
        after = answered_by(tap, set(CONVERSATIONS), len(CONVERSATIONS))
        assert {c: models[0] for c, models in after.items()} == {c: "acme-lora@2" for c in CONVERSATIONS}
    finally:
        for version in (v1, v2, other):
            publish_model_version(kafka, replace(version, state=ModelState.RETIRED, state_reason="test done",
                                                 updated_at=now_ms()))
        wait_listed(pipeline, auth, lambda ids: ids == [DEFAULT_MODEL_NAME])
        tap.consumer.close()

    # The turns name the exact version too (what the dataset rows take their `model` from).
    turns = Tap(kafka, TURNS)
    try:
        by_conversation = {t.conversation_id: t.model for t in (turns.codec.decode(m.value()) for m in turns.messages(
            1, 60, where=lambda m: turns.codec.decode(m.value()).conversation_id == "explicit-1"))}
        assert by_conversation == {"explicit-1": "acme-lora@2"}
    finally:
        turns.consumer.close()


def wait_listed(pipeline, auth, condition, timeout_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        ids = [m["id"] for m in httpx.get(f"{pipeline.url}/v1/models", headers=auth, timeout=30).json()["data"]]
        if condition(ids) or time.monotonic() > deadline:
            assert condition(ids), ids
            return
        time.sleep(0.2)
