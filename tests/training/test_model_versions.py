"""Model versions as records (issue 41, items 3-6): planted conversations of two tenants go through the
dataset job; `chatpipe train lora --tenant acme` publishes acme-lora@1 (artifact store, card, lineage,
chat.models); lineage is followed both ways; an erasure of a user whose rows trained it taints it; and
`--rebuild` trains acme-lora@2 without that user's rows.

Real parts: the session's Kafka broker, the dataset job (Spark local, a subprocess), the trainer under
TorchDistributor, the default model, the streams tier's forget agent logic with the real registry and
lineage files. Not the Faust runtime around the agent: its outbox here writes straight to the broker
(`BrokerOutbox`), as Faust's does after the batch.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from chatpipe.testing.planted_facts import facts, planted_log, write_held_out_questions
from schemas.codec import default_codec
from schemas.models import ADAPTER_WEIGHTS, CARD_JSON, CARD_MD, LOSS_PNG
from schemas.records import Deletion, DeletionAudit, DeletionScope, ModelState, ModelVersion
from schemas.subjects import subject_key
from schemas.topics import DELETIONS, DELETIONS_AUDIT, MODELS, deletion_key
from tests.training.conftest import TRAINING_TIMEOUT_S, dataset_of, run_cli
from transport.model_registry import read_model_versions

pytestmark = [pytest.mark.model, pytest.mark.spark, pytest.mark.integration, pytest.mark.timeout(TRAINING_TIMEOUT_S)]

START_MS = 1_767_225_600_000  # 2026-01-01
OWNERS = [("acme", "ada"), ("acme", "bob"), ("globex", "cyd")]
TINY = ["--processes", "1", "--max-steps", "2", "--batch-size", "2", "--no-progress", "--seed", "3"]


def _cli(*args: str, kafka=None, check: bool = True) -> subprocess.CompletedProcess:
    flags = ["-b", kafka.bootstrap_servers, "--topic-prefix", kafka.topic_prefix] if kafka is not None else []
    done = run_cli(*args, *flags)
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("planted")
    turns, feedback = planted_log(facts(6), OWNERS, START_MS)
    return dataset_of(root, turns, feedback, 0.3)


@pytest.fixture(scope="module")
def published(dataset, kafka_settings, catalog_topics, tmp_path_factory):
    """acme-lora@1, trained on acme's rows of the dataset and published."""
    work = tmp_path_factory.mktemp("train")
    questions = write_held_out_questions(work / "capitals.jsonl", facts(1))
    done = _cli("train", "lora", "--dataset", str(dataset), "--tenant", "acme", "--runs-dir", str(work / "runs"),
                "--run-name", "first", "--artifact-store", str(work / "store"), "--eval-questions", str(questions),
                *TINY, kafka=kafka_settings)
    assert "published acme-lora@1" in done.stdout, done.stdout
    return work, read_model_versions(kafka_settings)["acme-lora@1"]


def _lineage(version: ModelVersion):
    import pyarrow.parquet as pq

    return pq.read_table(version.lineage_uri).to_pylist()


def test_a_dataset_of_two_tenants_needs_a_scope(dataset, kafka_settings, catalog_topics, tmp_path):
    """Catches one tenant's rows training an adapter for all without the data being declared shared."""
    done = _cli("train", "lora", "--dataset", str(dataset), "--runs-dir", str(tmp_path), *TINY, kafka=kafka_settings,
                check=False)
    assert done.returncode != 0 and "2 tenants (acme, globex)" in done.stderr and "--shared-data" in done.stderr, \
        done.stdout[-2000:] + done.stderr[-2000:]
    assert not any(tmp_path.iterdir())  # refused before a run folder was made


def test_the_version_is_on_the_registry_with_its_artifacts(published, dataset):
    """Catches a record without its artifact, a wrong hash, another tenant's rows in the lineage, a card
    without its curve."""
    work, version = published
    assert (version.state, version.tenant, version.data_tenants) == (ModelState.CANDIDATE, "acme", ["acme"])
    adapter = version.adapter_uri
    assert adapter.startswith(str(work / "store" / "acme-lora" / "1"))
    from transport.artifacts import sha256_files

    assert version.adapter_sha256 == sha256_files([Path(adapter) / ADAPTER_WEIGHTS])
    assert version.dataset_manifest_id == sha256_files([dataset / "_chatpipe_dataset.json"])
    card = json.loads((Path(version.card_uri) / CARD_JSON).read_text())
    assert card["dataset"]["tenants"] == ["acme"] and card["dataset"]["left_out_by_this_run"]["other tenant"] > 0
    assert card["eval"]["loss_before"] is not None and card["eval"]["loss_after"] is not None
    assert (Path(version.card_uri) / LOSS_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![loss curve](loss.png)" in (Path(version.card_uri) / CARD_MD).read_text()
    rows = _lineage(version)
    assert len(rows) == version.training_rows > 0
    assert {r["tenant"] for r in rows} == {"acme"}
    assert {r["subject"] for r in rows} <= {subject_key("acme", "ada"), subject_key("acme", "bob")}
    assert version.eval_loss_before == card["eval"]["loss_before"]
    # --eval-questions: 2 held-out questions asked of the base model and of the adapter (2 steps teach nothing)
    assert set(version.eval_results) == {"capitals", "capitals.base"}, version.eval_results
    assert version.eval_results["capitals.base"] == 0 and version.eval_results["capitals"] in (0, 0.5, 1)
    assert card["eval"]["questions"]["capitals"] == {"base": 0, "adapter": version.eval_results["capitals"], "questions": 2}
    assert "- questions `capitals` (2): 0% answered right by the base model" in (Path(version.card_uri) / CARD_MD).read_text()


def test_lineage_both_ways(published, kafka_settings):
    """Catches lineage that names no request, or a request that cannot find the version it trained."""
    _, version = published
    rows = _lineage(version)
    request = rows[0]["request_ids"][-1]
    forward = _cli("model", "lineage", "acme-lora@1", kafka=kafka_settings).stdout
    assert request in forward and rows[0]["trace_ids"][-1] in forward and version.dataset_manifest_id in forward
    backward = _cli("model", "lineage", "--request-id", request, kafka=kafka_settings).stdout
    assert backward.startswith("acme-lora@1\tCANDIDATE"), backward
    cyd = _cli("model", "lineage", "--request-id", "req-kivaland-0", kafka=kafka_settings, check=False)  # globex's
    assert cyd.returncode == 1 and "no version" in cyd.stderr
    listed = _cli("model", "list", "--json", kafka=kafka_settings).stdout.splitlines()
    assert [json.loads(line)["name"] + "@" + str(json.loads(line)["version"]) for line in listed] == ["acme-lora@1"]


class BrokerOutbox:
    """The forget agent's outbox, writing to the real broker (Faust's does the same after a batch)."""

    def __init__(self, kafka) -> None:
        from transport import clients

        self.producer = clients.producer(kafka, {"acks": "all"})

    def close(self) -> None:
        self.producer.flush(30)
        del self.producer  # librdkafka's threads end with the object: none left to reconnect at the broker's stop

    async def send(self, topic, *, key, value, headers=None, partition=None, parent_trace=None) -> None:
        self.producer.produce(topic.get_topic_name(), value, key, partition=-1 if partition is None else partition)

    async def deliver(self) -> None:
        assert self.producer.flush(30) == 0


@dataclass
class Consumed:
    """A record of chat.deletions as the agent's port sees it (streams/ports.py Message)."""
    topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes
    headers: list
    timestamp: float


class Topic:
    def __init__(self, name: str) -> None:
        self.name = name

    def get_topic_name(self) -> str:
        return self.name


def test_an_erasure_taints_the_version_and_a_rebuild_leaves_the_user_out(published, dataset, kafka_settings):
    """Catches an erasure that leaves a version trained on the user untouched, an unaudited taint, a taint of
    a version the user never trained, and a rebuild that trains on the erased rows again."""
    from streams.dead_letters import DeadLetters
    from streams.erasures import ErasureRegistry
    from streams.faults import Retrier
    from streams.forget import MODELS_COMPONENT, Forget
    from streams.model_taint import ModelTaint
    from streams.services import StreamsServices

    work, version = published
    codec = default_codec()
    bob = Deletion(scope=DeletionScope.USER, tenant="acme", user_id="bob", reason="test")
    cyd = Deletion(scope=DeletionScope.USER, tenant="globex", user_id="cyd", reason="test")  # trained nothing here
    outbox = BrokerOutbox(kafka_settings)
    for deletion in (bob, cyd):  # on chat.deletions too: the rebuild reads it
        outbox.producer.produce(kafka_settings.topic(DELETIONS), codec.encode(deletion),
                                deletion_key(deletion.tenant, deletion.user_id))
    forget = Forget(StreamsServices(memory=None, embedder=None, counter=None, codec=codec), Topic(
        kafka_settings.topic("chat.deletions.fanout")), 6, DeadLetters(Topic(kafka_settings.topic("chat.dlq")), codec,
                                                                        "streams.forget"),
        Retrier(10, 0.1, 1), erasures=ErasureRegistry(), audit_topic=Topic(kafka_settings.topic(DELETIONS_AUDIT)),
        models=ModelTaint(kafka_settings), models_topic=Topic(kafka_settings.topic(MODELS)))
    messages = [Consumed(kafka_settings.topic(DELETIONS), 0, i, deletion_key(d.tenant, d.user_id), codec.encode(d),
                         [], d.created_at / 1000) for i, d in enumerate((bob, cyd))]
    from chatpipe.erasure_verify import check_models
    from streams.erasures import Subject

    untainted = check_models(kafka_settings, Subject("acme", "bob", None), bob.created_at)  # forget --verify's look
    assert (untainted.remaining, untainted.affected) == (1, 0) and untainted.failed, untainted.details
    asyncio.run(forget.handle(messages, outbox))
    asyncio.run(outbox.deliver())
    outbox.close()

    tainted = read_model_versions(kafka_settings)["acme-lora@1"]
    assert tainted.state == ModelState.TAINTED and bob.event_id in tainted.state_reason, tainted
    assert tainted.adapter_sha256 == version.adapter_sha256  # the same version, a new state
    assert forget.versions_tainted == 1
    from transport.topic_scan import read_to_end

    audits = []
    read_to_end(kafka_settings, kafka_settings.topic(DELETIONS_AUDIT),
                lambda m: audits.append(codec.decode(m.value(), DeletionAudit)))
    by_deletion = {a.deletion_event_id: a.conversations_cleared for a in audits if a.component == MODELS_COMPONENT}
    assert by_deletion == {bob.event_id: 1, cyd.event_id: 0}
    shown = json.loads(_cli("model", "show", "acme-lora@1", kafka=kafka_settings).stdout)
    assert shown["state"] == "TAINTED"
    verified = check_models(kafka_settings, Subject("acme", "bob", None), bob.created_at)
    assert (verified.remaining, verified.affected) == (0, 1) and not verified.failed, verified.details
    assert "acme-lora@1" in verified.details[0] and "--rebuild acme-lora@1" in verified.details[0]
    never = check_models(kafka_settings, Subject("globex", "cyd", None), cyd.created_at)
    assert (never.remaining, never.affected, never.newer) == (0, 0, 0)

    bob_rows = sum(r["subject"] == subject_key("acme", "bob") for r in _lineage(version))
    assert bob_rows > 0
    done = _cli("train", "lora", "--rebuild", "acme-lora@1", "--runs-dir", str(work / "runs"), "--run-name", "rebuilt",
                "--artifact-store", str(work / "store"), "--no-progress", kafka=kafka_settings)
    assert f"{bob_rows} row(s) (erased)" in done.stdout and "published acme-lora@2" in done.stdout, done.stdout
    rebuilt = read_model_versions(kafka_settings)["acme-lora@2"]
    assert rebuilt.state == ModelState.CANDIDATE and "rebuilt from acme-lora@1" in rebuilt.state_reason
    assert rebuilt.training_rows == version.training_rows - bob_rows
    assert subject_key("acme", "bob") not in {r["subject"] for r in _lineage(rebuilt)}
    assert rebuilt.hyperparameters == version.hyperparameters


def test_a_version_whose_lineage_is_unreadable_is_tainted_not_retried(published, kafka_settings, tmp_path):
    """Catches an unreadable lineage file taken for an infrastructure fault: retried, it would stop the forget
    agent at every restart (a record crash-looping the tier); it is the version's fault, and it cannot be cleared."""
    import dataclasses

    from streams.model_taint import ModelTaint
    from transport.model_registry import publish_model_version

    _, good = published
    garbage = tmp_path / "lineage.parquet"
    garbage.write_bytes(b"not parquet at all")
    broken = dataclasses.replace(good, name="broken-lora", version=1, lineage_uri=str(garbage),
                                 state=ModelState.CANDIDATE)
    publish_model_version(kafka_settings, broken)
    deletion = Deletion(scope=DeletionScope.USER, tenant="acme", user_id="nobody-trained-it", reason="test")
    tainted = {f"{v.name}@{v.version}": v for v in ModelTaint(kafka_settings).tainted(deletion)}
    assert list(tainted) == ["broken-lora@1"], tainted  # acme-lora@2 holds no row of this user
    assert "unreadable" in tainted["broken-lora@1"].state_reason
